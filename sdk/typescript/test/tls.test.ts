/**
 * TLS against real `kiln serve --tls-cert ... --tls-key ...` processes (one of them also with
 * --tls-client-ca), over a throwaway PKI made by test/tls_certs.py: `{ tls: { ca } }` works, and a
 * plaintext client, a client trusting another CA (or the system's roots) and, where client certificates
 * are required, a client without one signed by the client CA are refused without an answer.
 */
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";

import { Client, type ClientOptions, InvalidArgumentError, UnavailableError } from "@kiln/client";

import { type KilnServe, ownServer, PACKAGE, PYTHON } from "./helpers.js";

/** A refused call fails at the handshake; the deadline only keeps a hang from hanging the run. */
const REFUSAL_BOUND_MS = 30_000;

type PkiFile =
  | "ca"
  | "server_cert"
  | "server_key"
  | "other_ca"
  | "client_ca"
  | "client_cert"
  | "client_key"
  | "stranger_cert"
  | "stranger_key"
  | "junk";

const scratch = mkdtempSync(join(tmpdir(), "kiln-ts-tls-"));
const paths = JSON.parse(
  execFileSync(PYTHON, [join(PACKAGE, "test/tls_certs.py"), scratch], { encoding: "utf8" }),
) as Record<PkiFile, string>;
const pem = (name: PkiFile): string => readFileSync(paths[name], "utf8");

async function withClient<T>(address: string, options: ClientOptions, use: (client: Client) => Promise<T>): Promise<T> {
  const client = new Client(address, { timeoutMs: REFUSAL_BOUND_MS, ...options });
  try {
    return await use(client);
  } finally {
    client.close();
  }
}

/** A session and a short greedy generate on it: the tokens generated. */
async function turn(client: Client): Promise<number[]> {
  const session = await client.createSession({ tokens: [5, 6, 7, 8] });
  const tokens: number[] = [];
  for await (const token of session.generate({ maxTokens: 4, ignoreEos: true })) tokens.push(token);
  await session.close();
  return tokens;
}

async function refused(address: string, options: ClientOptions): Promise<void> {
  await withClient(address, options, (client) => assert.rejects(client.health(), UnavailableError));
}

describe("TLS", () => {
  let server: KilnServe;
  let mutual: KilnServe;
  const certificate = ["--tls-cert", paths.server_cert, "--tls-key", paths.server_key];

  before(async () => {
    [server, mutual] = await Promise.all([
      ownServer(certificate),
      ownServer([...certificate, "--tls-client-ca", paths.client_ca]),
    ]);
  });

  after(async () => {
    await Promise.all([server?.stop(), mutual?.stop()]);
    rmSync(scratch, { recursive: true, force: true });
  });

  it("{ tls: { ca } } serves a session, the CA as a string or a Buffer", async () => {
    for (const ca of [pem("ca"), Buffer.from(pem("ca"))]) {
      const tokens = await withClient(server.grpcAddress, { tls: { ca } }, turn);
      assert.equal(tokens.length, 4);
    }
    assert.ok(server.log.some((line) => line.includes("http=https://") && line.includes("(no auth, TLS)")));
  });

  it("a plaintext client is refused", async () => {
    await refused(server.grpcAddress, {});
    await refused(server.grpcAddress, { tls: false });
  });

  it("a client trusting another CA, or only the system's roots, is refused", async () => {
    await refused(server.grpcAddress, { tls: { ca: pem("other_ca") } });
    await refused(server.grpcAddress, { tls: true });
  });

  it("with --tls-client-ca, a certificate from the client CA is served", async () => {
    const tls = { ca: pem("ca"), cert: pem("client_cert"), key: Buffer.from(pem("client_key")) };
    assert.equal((await withClient(mutual.grpcAddress, { tls }, turn)).length, 4);
  });

  it("with --tls-client-ca, no certificate or one from another CA is refused", async () => {
    await refused(mutual.grpcAddress, { tls: { ca: pem("ca") } });
    await refused(mutual.grpcAddress, { tls: { ca: pem("ca"), cert: pem("stranger_cert"), key: pem("stranger_key") } });
  });

  it("bad TLS options are InvalidArgumentError when the client is made", () => {
    const cases: [unknown, RegExp][] = [
      [{ cert: pem("client_cert") }, /tls\.cert needs tls\.key/],
      [{ key: pem("client_key") }, /tls\.key needs tls\.cert/],
      [{ ca: 42 }, /tls\.ca must be PEM text/],
      ["yes", /tls must be true, false or/],
      [{ ca: pem("junk") }, /tls\.ca holds no PEM certificate/],
      [{ cert: pem("client_key"), key: pem("client_key") }, /tls\.cert holds no PEM certificate/],
      [{ cert: pem("client_cert"), key: pem("junk") }, /tls: cannot use the given PEM/],
      [{ ca: pem("ca"), cert: pem("client_cert"), key: pem("server_key") }, /tls: cannot use the given PEM/],
    ];
    for (const [tls, message] of cases) {
      assert.throws(() => new Client(server.grpcAddress, { tls: tls as ClientOptions["tls"] }), (error: unknown) => {
        assert.ok(error instanceof InvalidArgumentError, `${String(error)}`);
        assert.match(error.message, message);
        return true;
      });
    }
  });
});
