/**
 * Real `kiln serve` processes for the tests, on free loopback ports over the tiny random model of the
 * Python server tests (tests/server/conftest.py), and what the test files share about them. test/run.ts
 * starts the shared servers once and hands them to every test file in KILN_TEST_SERVERS.
 */
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { once } from "node:events";
import { createServer } from "node:net";
import { dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

import type { Tokenizer } from "@kiln/client";

export const PACKAGE = resolve(dirname(fileURLToPath(import.meta.url)), "..");
export const ROOT = resolve(PACKAGE, "../..");
export const PYTHON = process.env.KILN_PYTHON ?? join(ROOT, ".venv/bin/python");
const READY = "kiln serve: ready";
const START_TIMEOUT_MS = 240_000;
const START_ATTEMPTS = 3; // a free port can be taken before the server binds it (another server picking ports at once)
const PORT_TAKEN = "address already in use"; // as kiln serve reports either port taken (any case)

/** A server as the test files see it. */
export interface ServerInfo {
  grpcAddress: string;
  httpUrl: string;
  apiKeys: string[];
}

/** The servers test/run.ts started: `open` takes no key, `keyed` takes either of its two keys. */
export interface SharedServers {
  open: ServerInfo;
  keyed: ServerInfo;
}

/** A `kiln serve` process; `spawn` starts it, `ready` waits for its ready line. */
export class KilnServe implements ServerInfo {
  readonly log: string[] = [];
  private readonly started: Promise<void>;

  private constructor(
    readonly child: ChildProcess,
    readonly grpcAddress: string,
    readonly httpUrl: string,
    readonly apiKeys: string[],
  ) {
    this.started = new Promise<void>((resolve, reject) => {
      createInterface({ input: child.stderr! }).on("line", (line) => {
        this.log.push(line);
        if (line.startsWith(READY)) resolve();
      });
      child.once("exit", () => reject(new Error(`kiln serve exited before it was ready:\n${this.log.join("\n")}`)));
    });
    this.started.catch(() => {}); // reported by ready()
  }

  /** `spawn`, then `ready`; started again on other ports if one of its ports was taken meanwhile. */
  static async start(model: string, cacheDir: string, apiKeys: string[] = [], extra: string[] = []): Promise<KilnServe> {
    for (let attempt = 1; ; attempt++) {
      const server = await KilnServe.spawn(model, cacheDir, apiKeys, extra);
      try {
        return await server.ready();
      } catch (error) {
        if (attempt === START_ATTEMPTS || !server.log.some((line) => line.toLowerCase().includes(PORT_TAKEN))) throw error;
      }
    }
  }

  /** Starts `kiln serve --model <model>` on free loopback ports, with `apiKeys` if any. */
  static async spawn(model: string, cacheDir: string, apiKeys: string[] = [], extra: string[] = []): Promise<KilnServe> {
    const [grpcPort, httpPort] = [await freePort(), await freePort()];
    const args = ["-m", "kiln.cli", "serve", "--model", model, "--grpc-port", `${grpcPort}`, "--http-port",
      `${httpPort}`, "--kv-budget-mb", "64", ...apiKeys.flatMap((key) => ["--api-key", key]), ...extra];
    if (!extra.some((arg) => arg.startsWith("--snapshot"))) args.push("--no-persist"); // never the real home's data dir
    const env: NodeJS.ProcessEnv = { ...process.env, KILN_CACHE_DIR: cacheDir };
    delete env.KILN_API_KEY;
    const child = spawn(PYTHON, args, { cwd: ROOT, env, stdio: ["ignore", "ignore", "pipe"] });
    return new KilnServe(child, `127.0.0.1:${grpcPort}`, `http://127.0.0.1:${httpPort}`, apiKeys);
  }

  /** Resolves once the server printed its ready line; kills it after START_TIMEOUT_MS. */
  async ready(): Promise<this> {
    const timer = setTimeout(() => this.child.kill("SIGKILL"), START_TIMEOUT_MS);
    try {
      await this.started;
    } finally {
      clearTimeout(timer);
    }
    return this;
  }

  /** SIGTERM, then SIGKILL if it has not exited within `timeoutMs`. */
  async stop(timeoutMs = 30_000): Promise<void> {
    if (this.child.exitCode !== null || this.child.signalCode !== null) return;
    const exited = once(this.child, "exit");
    this.child.kill("SIGTERM");
    const timer = setTimeout(() => this.child.kill("SIGKILL"), timeoutMs);
    await exited;
    clearTimeout(timer);
  }
}

/** Writes the tiny model directory under `root` (by the Python tests' own code) and returns its path. */
export function tinyModel(root: string): string {
  return execFileSync(PYTHON, [join(PACKAGE, "test/tiny_model.py"), root], { encoding: "utf8" }).trim();
}

export async function freePort(): Promise<number> {
  const probe = createServer();
  probe.listen(0, "127.0.0.1");
  await once(probe, "listening");
  const { port } = probe.address() as { port: number };
  probe.close();
  await once(probe, "close");
  return port;
}

/** The shared servers, in a test file run by test/run.ts. */
export function sharedServers(): SharedServers {
  const servers = process.env.KILN_TEST_SERVERS;
  if (servers === undefined) throw new Error("run the tests with `npm test` (test/run.ts starts the servers)");
  return JSON.parse(servers) as SharedServers;
}

/**
 * A `kiln serve` of a test file's own, with `extra` flags, on the shared servers' model and weight cache
 * (test/run.ts passes them in KILN_TEST_MODEL and KILN_TEST_CACHE); the test file stops it.
 */
export async function ownServer(extra: string[]): Promise<KilnServe> {
  const { KILN_TEST_MODEL: model, KILN_TEST_CACHE: cache } = process.env;
  if (model === undefined || cache === undefined) throw new Error("run the tests with `npm test` (test/run.ts)");
  return KilnServe.start(model, cache, [], extra);
}

/** kiln_requests_total{route, status} from the server's /metrics (0 when never observed). */
export async function requestsCounted(server: ServerInfo, route: string, status: string): Promise<number> {
  const text = await (await fetch(`${server.httpUrl}/metrics`)).text();
  const line = text.split("\n").find((l) => l.startsWith(`kiln_requests_total{route="${route}",status="${status}"}`));
  return line === undefined ? 0 : Number(line.split(" ").at(-1));
}

/** Polls `condition` every 20 ms until it holds, or fails after `timeoutMs`. */
export async function eventually(condition: () => Promise<boolean>, what: string, timeoutMs = 10_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await condition())) {
    if (Date.now() > deadline) throw new Error(`never happened: ${what}`);
    await sleep(20);
  }
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * A history no other test used, so the server's prefix cache holds none of it (40 tokens: two full
 * 16-token pages, ids in [3, 256) of the tiny model's vocabulary).
 */
export function history(length = 40): number[] {
  return Array.from({ length }, () => 3 + Math.floor(Math.random() * 253));
}

/** max_tokens of a generation that is still running when a test interrupts it. */
export const LONG = 400;

/** The error `promise` rejects with; fails the test when it resolves. */
export async function rejection(promise: Promise<unknown>): Promise<unknown> {
  try {
    await promise;
  } catch (error) {
    return error;
  }
  throw new Error("expected a rejection, but the call succeeded");
}

/**
 * The tiny model's tokenizer in this process (tests/conftest.py byte_tokenizer): byte-level BPE without
 * merges, one id per UTF-8 byte, the id being the rank of the byte's character in GPT-2's byte-to-unicode
 * map (printable bytes stand for themselves, the others for 256, 257, ... in byte order).
 */
export function byteTokenizer(): Tokenizer {
  const printable = (byte: number): boolean => (byte >= 33 && byte <= 126) || (byte >= 161 && byte !== 173);
  let shifted = 256;
  const charOfByte = Array.from({ length: 256 }, (_, byte) => (printable(byte) ? byte : shifted++));
  const ranked = [...charOfByte].sort((a, b) => a - b);
  const idOfByte = charOfByte.map((char) => ranked.indexOf(char));
  const byteOfId = new Map(idOfByte.map((id, byte) => [id, byte]));
  return {
    encode: (text) => [...Buffer.from(text, "utf8")].map((byte) => idOfByte[byte]!),
    decode: (ids) => Buffer.from(ids.map((id) => byteOfId.get(id)!)).toString("utf8"),
  };
}
