/**
 * Leaving a generation early against a real `kiln serve`: an AbortSignal (the server sees CANCELLED and
 * the session keeps the tokens committed before it), cancel(), a `break`, deadlines, and a closed client.
 * Each frees the session for the next call by the time it returns or throws.
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { CancelledError, Client, DeadlineExceededError, type Session } from "@kiln/client";

import { eventually, history, LONG, rejection, requestsCounted, sharedServers } from "./helpers.js";

const { open } = sharedServers();
const CANCELLED = (): Promise<number> => requestsCounted(open, "grpc/Generate", "CANCELLED");

describe("cancellation and deadlines", () => {
  let client: Client;
  before(() => {
    client = new Client(open.grpcAddress, { tokenizer: "server" });
  });
  after(() => client.close());

  /** The session continues: a short generate works at once and grows the history by its tokens. */
  async function stillServes(session: Session): Promise<void> {
    const before = (await session.info()).historyTokens;
    assert.equal((await session.generate({ maxTokens: 3, ignoreEos: true }).result()).usage.generatedTokens, 3);
    assert.equal((await session.info()).historyTokens, before + 3);
  }

  it("an AbortSignal stops a generate: CancelledError after the tokens received, the history keeps them", async () => {
    const cancelledBefore = await CANCELLED();
    const session = await client.createSession({ tokens: history() });
    const abort = new AbortController();
    const generation = session.generate({ maxTokens: LONG, ignoreEos: true, signal: abort.signal });
    const seen: number[] = [];
    const error = await rejection(
      (async () => {
        for await (const id of generation) {
          seen.push(id);
          if (seen.length === 2) abort.abort("the user pressed stop");
        }
      })(),
    );
    assert.ok(error instanceof CancelledError);
    assert.equal(error.cause, "the user pressed stop");
    assert.deepEqual(seen, generation.tokenIds); // every token received was handed out before the error
    assert.equal(generation.finishReason, "cancelled");
    assert.equal(generation.usage, null);
    await assert.rejects(generation.result(), CancelledError);

    const info = await session.info();
    assert.equal(info.generating, false);
    assert.ok(info.historyTokens >= 40 + seen.length && info.historyTokens < 40 + LONG, `${info.historyTokens}`);
    await eventually(async () => (await CANCELLED()) > cancelledBefore, "the server counts a CANCELLED Generate");
    await stillServes(session);
  });

  it("an AbortSignal aborted before the generate starts it not at all", async () => {
    const session = await client.createSession({ tokens: history() });
    const generation = session.generate({ maxTokens: LONG, signal: AbortSignal.abort("never mind") });
    await assert.rejects(generation.result(), { name: "CancelledError", cause: "never mind" });
    assert.equal((await session.info()).generating, false);
    await stillServes(session);
  });

  it("an AbortSignal stops generateText with CancelledError", async () => {
    const session = await client.createSession({ tokens: history() });
    const abort = new AbortController();
    const pieces: string[] = [];
    await assert.rejects(async () => {
      for await (const piece of session.generateText({ maxTokens: LONG, ignoreEos: true, signal: abort.signal })) {
        pieces.push(piece);
        abort.abort();
      }
    }, CancelledError);
    assert.equal((await session.info()).generating, false);
    await stillServes(session);
  });

  it("cancel() ends the iteration quietly after the tokens already received", async () => {
    const cancelledBefore = await CANCELLED();
    const session = await client.createSession({ tokens: history() });
    const generation = session.generate({ maxTokens: LONG, ignoreEos: true });
    const tokens = generation[Symbol.asyncIterator]();
    const received = [(await tokens.next()).value, (await tokens.next()).value];
    await generation.cancel();
    assert.equal(generation.finishReason, "cancelled");
    assert.equal(generation.usage, null);
    const rest: number[] = [];
    for (let next = await tokens.next(); !next.done; next = await tokens.next()) rest.push(next.value);
    assert.deepEqual([...received, ...rest], generation.tokenIds);
    await assert.rejects(generation.result(), {
      name: "CancelledError",
      message: "the generation was cancelled by this client; it has no final accounting",
    });
    await generation.cancel(); // again: nothing to do
    const info = await session.info();
    assert.ok(!info.generating && info.historyTokens >= 42 && info.historyTokens < 40 + LONG);
    await stillServes(session);
    await eventually(async () => (await CANCELLED()) > cancelledBefore, "the server counts a CANCELLED Generate");
  });

  it("leaving the loop with break cancels and frees the session", async () => {
    const session = await client.createSession({ tokens: history() });
    for await (const id of session.generate({ maxTokens: LONG, ignoreEos: true })) {
      assert.equal(typeof id, "number");
      break;
    }
    assert.equal((await session.info()).generating, false);
    await stillServes(session);
  });

  it("a generate past its deadline is DeadlineExceededError, and the next generate works at once", async () => {
    const session = await client.createSession({ tokens: history() });
    // Sampled, not greedy: a tiny model's greedy text loops, speculation then drafts it whole and 900
    // tokens can take less than the deadline.
    const generation = session.generate({ maxTokens: 900, ignoreEos: true, temperature: 1, seed: 1, timeoutMs: 300 });
    await assert.rejects(generation.result(), DeadlineExceededError);
    assert.ok(generation.tokenIds.length < 900);
    // no wait for the server to settle the cancel: the next generate waits there for it (issue 37)
    const next = await session.generate({ maxTokens: 3, ignoreEos: true }).result();
    assert.equal(next.usage.generatedTokens, 3);
    const info = await session.info();
    assert.equal(info.generating, false);
    assert.ok(info.historyTokens >= 40 + 3 && info.historyTokens < 40 + 900 + 3, `${info.historyTokens}`);
  });

  it("two generates on one session both complete, in the order they came", async () => {
    const session = await client.createSession({ tokens: history() });
    const first = session.generate({ maxTokens: 200, ignoreEos: true, temperature: 1, seed: 1 });
    await first.accepted(); // in flight: 200 tokens to go
    const second = session.generate({ maxTokens: 5, ignoreEos: true });
    const [a, b] = await Promise.all([first.result(), second.result()]);
    const reply = await fetch(`${open.httpUrl}/v1/sessions/${session.id}/tokens`); // the REST mirror lists the ids
    const { token_ids: ids } = (await reply.json()) as { token_ids: number[] };
    assert.deepEqual(ids.slice(40), [...a.tokenIds, ...b.tokenIds]);
  });

  it("a unary call past its deadline is DeadlineExceededError", async () => {
    await assert.rejects(client.health({ timeoutMs: 0 }), DeadlineExceededError);
    const impatient = new Client(open.grpcAddress, { timeoutMs: 0 });
    await assert.rejects(impatient.listSessions(), DeadlineExceededError);
    impatient.close();
    assert.equal((await client.health({ timeoutMs: 10_000 })).status, "serving");
  });

  it("an aborted signal cancels a unary call before it is sent", async () => {
    const sessions = (await client.listSessions()).length;
    await assert.rejects(client.createSession({ tokens: [1], signal: AbortSignal.abort() }), CancelledError);
    assert.equal((await client.listSessions()).length, sessions);
  });

  it("a closed client refuses every call, and ends the generations it had running", async () => {
    const closing = new Client(open.grpcAddress, { tokenizer: "server" });
    const session = await closing.createSession({ tokens: [1, 2, 3] });
    const running = session.generate({ maxTokens: LONG, ignoreEos: true });
    const tokens = running[Symbol.asyncIterator]();
    await tokens.next();
    closing.close();
    const calls = [
      () => closing.createSession({ tokens: [1] }),
      () => closing.getSession(session.id),
      () => closing.listSessions(),
      () => closing.tokenize("x"),
      () => closing.detokenize([1]),
      () => closing.health(),
      () => session.append([1]),
      () => session.appendText("x"),
      async () => session.generate({ maxTokens: 2 }),
      () => session.generateText({ maxTokens: 2 }),
      () => session.fork(),
      () => session.info(),
      () => session.close(),
      async () => {
        for (let next = await tokens.next(); !next.done; next = await tokens.next());
      },
      () => running.result(),
    ];
    for (const call of calls) {
      await assert.rejects(call(), { name: "FailedPreconditionError", message: "the client is closed" });
    }
    closing.close(); // closing again is fine
    await eventually(async () => !(await client.getSession(session.id).then((s) => s.info())).generating, "the server ends the generation");
  });
});
