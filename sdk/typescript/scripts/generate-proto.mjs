// Regenerates src/gen/ (message types and the Runtime service definition for @grpc/grpc-js) from
// proto/kiln/v1/runtime.proto with ts-proto. protoc is the one `make proto` uses for the Python stubs
// (grpcio-tools in the repository's .venv, or $KILN_PYTHON), so nothing else needs installing.
//
//   npm run proto               rewrite src/gen/ (run after editing the .proto; `make proto` does it too)
//   node scripts/generate-proto.mjs DIR    write into DIR instead (test/proto.test.ts compares the two)
import { execFileSync } from "node:child_process";
import { mkdirSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const PACKAGE = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const ROOT = resolve(PACKAGE, "../..");
const PYTHON = process.env.KILN_PYTHON ?? join(ROOT, ".venv/bin/python");
const PROTOS = ["kiln/v1/runtime.proto"];
const OPTIONS = [
  "outputServices=grpc-js", // the service definition: paths and (de)serializers per method
  "env=node",
  "esModuleInterop=true",
  "importSuffix=.js", // Node's ESM resolution needs the extension
  "oneof=unions-value", // GenerateEvent.event is { $case: "tokens" | "finish", value }
  "outputJsonMethods=false", // the SDK speaks binary protobuf only
  "annotateFilesWithVersion=false", // stale means a different output, not another protoc release
];

const out = resolve(process.argv[2] ?? join(PACKAGE, "src/gen"));
mkdirSync(out, { recursive: true });
execFileSync(
  PYTHON,
  [
    "-m", "grpc_tools.protoc",
    `-I${join(ROOT, "proto")}`,
    `--plugin=protoc-gen-ts_proto=${join(PACKAGE, "node_modules/.bin/protoc-gen-ts_proto")}`,
    `--ts_proto_out=${out}`,
    `--ts_proto_opt=${OPTIONS.join(",")}`,
    ...PROTOS,
  ],
  { stdio: "inherit" },
);
for (const proto of PROTOS) console.log(`wrote ${join(out, proto.replace(/\.proto$/, ".ts"))}`);
