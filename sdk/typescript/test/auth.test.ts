/**
 * API keys against a real `kiln serve --api-key key-a --api-key key-b`: a missing or unknown key is
 * UnauthenticatedError on every call, and a session is invisible to any key but the one that created it.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { Client, NotFoundError, Session, UnauthenticatedError } from "@kiln/client";

import { rejection, sharedServers } from "./helpers.js";

const { keyed } = sharedServers();
const [keyA, keyB] = keyed.apiKeys as [string, string];

async function withClient<T>(apiKey: string | undefined, use: (client: Client) => Promise<T>): Promise<T> {
  const client = new Client(keyed.grpcAddress, { apiKey, tokenizer: "server" });
  try {
    return await use(client);
  } finally {
    client.close();
  }
}

describe("API keys", () => {
  for (const [apiKey, message] of [
    [undefined, "missing API key: send 'authorization: Bearer <key>'"],
    ["wrong-key", "unknown API key"],
  ] as const) {
    it(`${apiKey === undefined ? "a missing" : "an unknown"} key is UnauthenticatedError on every call`, async () => {
      await withClient(apiKey, async (client) => {
        const refused = { name: UnauthenticatedError.name, message };
        await assert.rejects(client.health(), refused);
        await assert.rejects(client.createSession({ tokens: [1] }), refused);
        await assert.rejects(client.listSessions(), refused);
        await assert.rejects(client.tokenize("x"), refused);
        const generation = new Session(client, "x".repeat(22)).generate({ maxTokens: 2 });
        await assert.rejects(generation.accepted(), refused);
        await assert.rejects(generation.result(), refused);
      });
    });
  }

  it("a session is invisible to other keys, exactly like an unknown id", async () => {
    await withClient(keyA, (a) =>
      withClient(keyB, async (b) => {
        const mine = await a.createSession({ tokens: [1, 2, 3] });
        const theirs = await b.createSession({ tokens: [4, 5] });
        const missing = "x".repeat(22);
        const foreign = await rejection(b.getSession(mine.id));
        const unknown = await rejection(b.getSession(missing));
        assert.ok(foreign instanceof NotFoundError && unknown instanceof NotFoundError);
        assert.equal(foreign.message.replace(mine.id, missing), unknown.message);

        const handle = new Session(b, mine.id); // key b holding key a's id
        const calls = [
          () => handle.info(),
          () => handle.append([1]),
          () => handle.appendText("x"),
          () => handle.generate({ maxTokens: 2 }).result(),
          () => handle.fork(),
          () => handle.close(),
        ];
        for (const call of calls) await assert.rejects(call(), NotFoundError);
        assert.ok((await a.listSessions()).some((info) => info.sessionId === mine.id));
        assert.deepEqual((await b.listSessions()).map((info) => info.sessionId), [theirs.id]);
        assert.equal((await mine.info()).historyTokens, 3); // untouched by b's attempts
      }),
    );
  });

  it("a key that is not header text is refused when the client is created", () => {
    for (const apiKey of ["ключ", "two words", "tab\tkey", "new\nline", "", " ", 5]) {
      assert.throws(() => new Client(keyed.grpcAddress, { apiKey: apiKey as string }), {
        name: "InvalidArgumentError",
        message: "apiKey must be a non-empty string of printable ASCII without spaces",
      });
    }
  });
});
