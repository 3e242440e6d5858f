/**
 * The checked-in src/gen/ is what scripts/generate-proto.mjs makes of proto/kiln/v1/runtime.proto now
 * (as tests/server/test_proto.py checks the Python stubs), and it defines every RPC of the proto.
 */
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";
import { describe, it } from "node:test";

import { RuntimeService } from "../dist/esm/gen/kiln/v1/runtime.js";
import { PACKAGE, ROOT } from "./helpers.js";

const GENERATED = join(PACKAGE, "src/gen");

function files(root: string): string[] {
  return readdirSync(root, { recursive: true, withFileTypes: true })
    .filter((entry) => entry.isFile())
    .map((entry) => relative(root, join(entry.parentPath ?? entry.path, entry.name)))
    .sort();
}

describe("generated code", () => {
  it("is what the generator makes of the proto now", () => {
    const fresh = mkdtempSync(join(tmpdir(), "kiln-ts-proto-"));
    try {
      execFileSync(process.execPath, [join(PACKAGE, "scripts/generate-proto.mjs"), fresh], { stdio: "pipe" });
      assert.deepEqual(files(fresh), files(GENERATED));
      const stale = files(fresh).filter(
        (name) => !readFileSync(join(fresh, name)).equals(readFileSync(join(GENERATED, name))),
      );
      assert.deepEqual(stale, [], "stale generated code: run `npm run proto` (or `make proto`) and commit src/gen/");
    } finally {
      rmSync(fresh, { recursive: true, force: true });
    }
  });

  it("defines every RPC of the proto", () => {
    const proto = readFileSync(join(ROOT, "proto/kiln/v1/runtime.proto"), "utf8");
    const rpcs = [...proto.matchAll(/^\s*rpc (\w+)\(/gm)].map((match) => `/kiln.v1.Runtime/${match[1]}`);
    assert.ok(rpcs.length >= 10);
    assert.deepEqual(Object.values(RuntimeService).map((method) => method.path).sort(), rpcs.sort());
  });
});
