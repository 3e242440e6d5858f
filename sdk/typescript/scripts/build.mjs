// Builds dist/esm (ES modules) and dist/cjs (CommonJS) from src/, each with its .d.ts files. The package
// is "type": "module", so dist/cjs gets a package.json of its own that makes Node load it as CommonJS.
import { execFileSync } from "node:child_process";
import { rmSync, writeFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const PACKAGE = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const tsc = join(PACKAGE, "node_modules/.bin/tsc");

rmSync(join(PACKAGE, "dist"), { recursive: true, force: true });
for (const config of ["tsconfig.json", "tsconfig.cjs.json"]) {
  execFileSync(tsc, ["-p", join(PACKAGE, config)], { stdio: "inherit" });
}
writeFileSync(join(PACKAGE, "dist/cjs/package.json"), '{ "type": "commonjs" }\n');
