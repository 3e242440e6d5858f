/**
 * Every RPC through the SDK against a real `kiln serve` (tiny llama, byte tokenizer): session turns that
 * prefill only new tokens, fork, info, list, reattach by id, tokenize, detokenize, health, the text
 * helpers (server and local tokenizer), chunks and logprobs, generates on one session in arrival order.
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { Client, FailedPreconditionError, InvalidArgumentError, NotFoundError } from "@kiln/client";

import { byteTokenizer, history, LONG, sharedServers } from "./helpers.js";

const { open } = sharedServers();

async function collect<T>(items: AsyncIterable<T>): Promise<T[]> {
  const collected: T[] = [];
  for await (const item of items) collected.push(item);
  return collected;
}

describe("sessions over a real kiln serve", () => {
  let client: Client;
  before(() => {
    client = new Client(open.grpcAddress, { tokenizer: "server" });
  });
  after(() => client.close());

  it("a sink_window session says how many positions it no longer reads", async () => {
    const session = await client.createSession({
      tokens: history(100), kvPolicy: "sink_window", kvSinkTokens: 16, kvWindowTokens: 32,
    });
    await session.generate({ maxTokens: 2, ignoreEos: true }).result();
    const info = await session.info();
    assert.deepEqual([info.forgottenTokens, info.invariantViolations], [48, 0]); // pages 1-3 of 101 computed
    await session.close();
  });

  it("a session gets its own KV policy; bad policy options are typed errors", async () => {
    const session = await client.createSession({
      tokens: history(100), kvPolicy: "restore", kvSinkTokens: 16, kvWindowTokens: 32,
    });
    await session.generate({ maxTokens: 2, ignoreEos: true }).result();
    const info = await session.info();
    assert.deepEqual([info.kvPolicy, info.kvSinkTokens, info.kvWindowTokens], ["restore", 16, 32]);
    assert.ok(info.hostTierBytes > 0, "evicted pages went to the host tier");
    assert.ok(info.tierBytesPerToken > 0 && info.kvBytesPerToken > 0);
    // the saver's status travels over the wire: once nothing is pending, the last save is recent
    let saved = info;
    for (let tries = 0; saved.unsavedChanges && tries < 600; tries += 1) {
      await new Promise((resolve) => setTimeout(resolve, 50));
      saved = await session.info();
    }
    assert.equal(saved.unsavedChanges, false);
    assert.equal(saved.saveFailures, 0);
    assert.ok(saved.lastSavedAt !== undefined && Math.abs(saved.lastSavedAt - Date.now() / 1000) < 60);
    await assert.rejects(client.createSession({ tokens: [5], kvPolicy: "lru" as "full" }), InvalidArgumentError);
    await assert.rejects(client.createSession({ tokens: [5], kvWindowTokens: -1 }), InvalidArgumentError);
    await assert.rejects(client.createSession({ tokens: [5], kvPolicy: "restore", kvWindowTokens: 3 }), /kv_window_tokens/);
  });

  it("turns prefill only new tokens; fork, info, list and reattach by id", async () => {
    const start = history();
    const session = await client.createSession({ tokens: start, ttlS: 3600 });
    const first = session.generate({ maxTokens: 6, ignoreEos: true });
    const tokens = await collect(first);
    assert.equal(tokens.length, 6);
    assert.equal(first.finishReason, "length");
    assert.deepEqual(first.usage, { promptTokens: 40, reusedTokens: 0, prefilledTokens: 40, generatedTokens: 6 });

    const info = await session.append([7, 8, 9]);
    assert.equal(info.historyTokens, 40 + 6 + 3);
    assert.equal(info.generating, false);
    assert.equal(info.ttlS, 3600);
    const second = await session.generate({ maxTokens: 5, ignoreEos: true }).result();
    // only the 3 appended tokens and the last generated one (never computed yet) are prefilled
    assert.equal(second.usage.prefilledTokens, 4);
    assert.equal(second.usage.reusedTokens, 40 + 6 - 1);
    assert.equal((await session.info()).lastPrefillTokens, 4);
    assert.equal((await session.info()).historyTokens, 54);

    // the whole history in a fresh session continues the same way (greedy)
    const fresh = await client.createSession({ tokens: [...start, ...tokens, 7, 8, 9] });
    assert.deepEqual((await fresh.generate({ maxTokens: 5, ignoreEos: true }).result()).tokenIds, second.tokenIds);

    const child = await session.fork();
    assert.notEqual(child.id, session.id);
    assert.equal((await child.info()).historyTokens, 54);
    const shared = (await child.generate({ maxTokens: 2, ignoreEos: true }).result()).usage;
    assert.ok(shared.reusedTokens >= 48 && shared.prefilledTokens <= 6, "the fork reused the parent's pages");
    assert.equal((await (await session.fork({ at: 10 })).info()).historyTokens, 10);

    const restarted = new Client(open.grpcAddress);
    try {
      const again = await restarted.getSession(session.id);
      assert.equal(again.id, session.id);
      assert.equal((await again.info()).historyTokens, 54);
      const listed = new Set((await restarted.listSessions()).map((s) => s.sessionId));
      for (const id of [session.id, child.id, fresh.id]) assert.ok(listed.has(id));
    } finally {
      restarted.close();
    }
  });

  it("close ends a session: every later call on it is NotFoundError", async () => {
    const session = await client.createSession({ tokens: [1, 2, 3] });
    await session.close();
    const calls = [
      () => session.info(),
      () => session.append([4]),
      () => session.generate({ maxTokens: 2 }).result(),
      () => session.fork(),
      () => session.close(),
    ];
    for (const call of calls) await assert.rejects(call(), { name: "NotFoundError", message: /closed/ });
    await assert.rejects(client.getSession(session.id), NotFoundError);
  });

  it("tokenize, detokenize, health", async () => {
    const ids = await client.tokenize("héllo ✓");
    assert.equal(ids.length, Buffer.byteLength("héllo ✓")); // the byte tokenizer: one id per UTF-8 byte
    assert.equal(await client.detokenize(ids), "héllo ✓");
    assert.deepEqual(await client.tokenize("héllo ✓", { addSpecialTokens: true }), ids); // it has no BOS
    assert.equal(await client.detokenize(Uint32Array.from(ids), { skipSpecialTokens: true }), "héllo ✓");
    const health = await client.health();
    assert.equal(health.status, "serving");
    assert.equal(health.vocabSize, 256);
    assert.ok(health.maxModelLen > 0 && health.kvPagesFree > 0 && health.sessions > 0);
    assert.equal(typeof health.model, "string");
  });

  it("token ids may be a number[], Uint32Array or Int32Array", async () => {
    const session = await client.createSession({ tokens: Uint32Array.of(1, 2, 3) });
    assert.equal((await session.append(Int32Array.of(4, 5))).historyTokens, 5);
    assert.equal((await session.append(new Set([6]))).historyTokens, 6);
    assert.equal((await (await client.createSession({ tokens: new Uint32Array(0) })).info()).historyTokens, 0);
    const generation = session.generate({ maxTokens: 2, ignoreEos: true, stopTokenIds: Uint32Array.of(0) });
    assert.equal((await generation.result()).tokenIds.length, 2);
  });

  it("the text helpers need an opted-in tokenizer", async () => {
    const idsOnly = new Client(open.grpcAddress);
    try {
      const session = await idsOnly.createSession({ tokens: [5, 6] });
      await assert.rejects(session.appendText("hi"), { name: "FailedPreconditionError", message: /appendText needs a tokenizer/ });
      await assert.rejects(session.generateText({ maxTokens: 2 }), { message: /generateText needs a tokenizer/ });
      assert.equal((await session.info()).generating, false);
    } finally {
      idsOnly.close();
    }
  });

  it("the text helpers agree across the server's and a local tokenizer", async () => {
    const local = byteTokenizer();
    assert.deepEqual(await local.encode("Grüße ✓", false), await client.tokenize("Grüße ✓"));
    const replies: string[] = [];
    for (const tokenizer of ["server", local] as const) {
      const textClient = new Client(open.grpcAddress, { tokenizer });
      try {
        const session = await textClient.createSession();
        const prompt = "Grüße, ";
        assert.equal((await session.appendText(prompt)).historyTokens, Buffer.byteLength(prompt));
        const pieces = await collect(session.generateText({ maxTokens: 24, ignoreEos: true }));
        assert.ok(pieces.slice(0, -1).every((piece) => !piece.endsWith("\ufffd")), "no half characters mid-stream");
        assert.equal((await session.info()).historyTokens, Buffer.byteLength(prompt) + 24);
        replies.push(pieces.join(""));
      } finally {
        textClient.close();
      }
    }
    assert.equal(replies[0], replies[1]);
  });

  it("generateText awaited is the whole reply, cut before a matched stop string", async () => {
    // the tiny random model often replies in half characters: draw histories until a reply has a whole one to stop at
    for (let attempt = 0; attempt < 8; attempt++) {
      const start = history();
      const whole = await (await client.createSession({ tokens: start })).generateText({ maxTokens: 48, ignoreEos: true });
      assert.equal(whole, await client.detokenize(await tokensAfter(start, 48), { skipSpecialTokens: true }));
      const at = [...whole.matchAll(/[^\ufffd]/gu)].find((match) => (match.index ?? 0) >= 2);
      if (!at) continue;
      const stop = at[0];
      const cut = await (await client.createSession({ tokens: start })).generateText({ maxTokens: 48, ignoreEos: true, stop });
      assert.equal(cut, whole.slice(0, whole.indexOf(stop)));
      return;
    }
    assert.fail("8 random histories gave no reply with a whole character past its start");
  });

  it("structured output: a regex or a JSON schema constrains the text; one that does not compile is refused", async () => {
    const session = await client.createSession({ tokens: history() });
    const yesNo = await session.generate({ maxTokens: 16, regex: "(yes|no)" }).result();
    assert.match(await client.detokenize(yesNo.tokenIds), /^(yes|no)$/);
    assert.equal(yesNo.finishReason, "stop");
    const schema = { type: "object", properties: { answer: { enum: ["yes", "no"] } }, required: ["answer"] };
    const json = await session.generateText({ maxTokens: 32, jsonSchema: schema });
    assert.ok(["yes", "no"].includes(JSON.parse(json).answer), json);
    await assert.rejects(session.generate({ maxTokens: 4, regex: "(" }).result(), {
      name: "InvalidArgumentError",
      message: /^regex does not compile/,
    });
  });

  it("sampling controls reach the engine: the penalised greedy reply is not the plain one", async () => {
    // tests/server/test_sampling_controls.py's prompt: a random history's plain greedy reply may repeat no token
    // of the history or of itself, and then the penalties rightly change nothing (seen on CI).
    const start = [34, 155, 11, 178, 80, 161, 46, 240];
    const reply = async (options: object): Promise<number[]> => {
      const session = await client.createSession({ tokens: start });
      return (await session.generate({ maxTokens: 12, ignoreEos: true, ...options }).result()).tokenIds;
    };
    const controls = { repetitionPenalty: 1.8, presencePenalty: 1.5, frequencyPenalty: 0.7, minP: 0.2 };
    const penalised = await reply(controls);
    assert.notDeepEqual(penalised, await reply({}));
    assert.deepEqual(await reply(controls), penalised);
  });

  it("chunks carry every token and its logprob", async () => {
    const session = await client.createSession({ tokens: history() });
    const generation = session.generate({ maxTokens: 12, ignoreEos: true, logprobs: true });
    const chunks = await collect(generation.chunks());
    assert.deepEqual(chunks.flat(), generation.tokenIds);
    assert.equal(generation.tokenIds.length, 12);
    assert.equal(generation.logprobs?.length, 12);
    assert.ok(generation.logprobs.every((logprob) => logprob <= 0));
    assert.equal((await generation.result()).usage.generatedTokens, 12);
    assert.equal(session.generate({ maxTokens: 1 }).logprobs, null);
  });

  it("generates on one session run one at a time, in arrival order; other sessions are unaffected", async () => {
    const session = await client.createSession({ tokens: history() });
    const running = session.generate({ maxTokens: LONG, ignoreEos: true });
    await running.accepted();
    const queued = session.generate({ maxTokens: 2, ignoreEos: true }); // waits for `running` to end
    await assert.rejects(session.append([1]), (error: Error) => error instanceof FailedPreconditionError && /in flight/.test(error.message));
    const other = await client.createSession({ tokens: history() });
    assert.equal((await other.generate({ maxTokens: 2, ignoreEos: true }).result()).usage.generatedTokens, 2);
    assert.equal((await session.info()).generating, true);
    await running.cancel();
    assert.equal((await queued.result()).usage.generatedTokens, 2);
    assert.equal((await session.info()).generating, false);
  });

  /** The greedy continuation of `start`, from a session of its own. */
  async function tokensAfter(start: number[], maxTokens: number): Promise<number[]> {
    const session = await client.createSession({ tokens: start });
    return (await session.generate({ maxTokens, ignoreEos: true }).result()).tokenIds;
  }
});
