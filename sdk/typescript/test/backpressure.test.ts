/**
 * Streaming under backpressure. Against a real `kiln serve`: slow and stalled readers get every token
 * once and in order (the same tokens a fast reader gets), and the server serves everyone else meanwhile.
 * Against a stand-in server that streams faster than anyone reads: a reader that stops reading holds the
 * server's writes back through gRPC flow control (the SDK reads one event at a time, never buffering
 * without bound), then gets everything.
 */
import assert from "node:assert/strict";
import { once } from "node:events";
import { after, before, describe, it } from "node:test";

import { Client, type Generation, Session } from "@kiln/client";

import { FinishReason } from "../dist/esm/gen/kiln/v1/runtime.js";
import { FakeRuntime, tokens } from "./fake-runtime.js";
import { history, sharedServers, sleep } from "./helpers.js";

describe("streaming under backpressure (kiln serve)", () => {
  let client: Client;
  before(() => {
    client = new Client(sharedServers().open.grpcAddress);
  });
  after(() => client.close());

  /** Greedy continuations are deterministic: the same history gives the same tokens at any read speed. */
  async function reference(start: number[], maxTokens: number): Promise<number[]> {
    const session = await client.createSession({ tokens: start });
    return (await session.generate({ maxTokens, ignoreEos: true }).result()).tokenIds;
  }

  it("a slow reader gets every token once, in order, as a fast one does", async () => {
    const start = history();
    const session = await client.createSession({ tokens: start });
    const generation = session.generate({ maxTokens: 120, ignoreEos: true });
    const chunks: number[][] = [];
    for await (const chunk of generation.chunks()) {
      chunks.push(chunk);
      await sleep(40);
    }
    assert.ok(chunks.every((chunk) => chunk.length > 0));
    assert.deepEqual(chunks.flat(), generation.tokenIds);
    assert.equal((await generation.result()).usage.generatedTokens, 120);
    assert.deepEqual(generation.tokenIds, await reference(start, 120));
  });

  it("stalled readers lose nothing, and the server serves everyone else meanwhile", async () => {
    const starts = [history(), history(), history()];
    const sessions = await Promise.all(starts.map((tokens) => client.createSession({ tokens })));
    const generations: Generation[] = sessions.map((session) => session.generate({ maxTokens: 200, ignoreEos: true }));
    await Promise.all(generations.map((generation) => generation.accepted()));
    // nobody reads for a while: other calls go on
    const other = await client.createSession({ tokens: history() });
    assert.equal((await other.generate({ maxTokens: 4, ignoreEos: true }).result()).usage.generatedTokens, 4);
    assert.equal((await client.health()).status, "serving");
    await sleep(1000);
    // then each reads at its own pace: one token at a time with pauses, by chunks, or all at once
    const readers = [
      async (generation: Generation) => {
        const ids: number[] = [];
        for await (const id of generation) {
          ids.push(id);
          if (ids.length % 50 === 0) await sleep(100);
        }
        return ids;
      },
      async (generation: Generation) => {
        const ids: number[] = [];
        for await (const chunk of generation.chunks()) ids.push(...chunk);
        return ids;
      },
      async (generation: Generation) => (await generation.result()).tokenIds,
    ];
    const read = await Promise.all(generations.map((generation, i) => readers[i]!(generation)));
    for (const [i, generation] of generations.entries()) {
      assert.deepEqual(read[i], generation.tokenIds);
      assert.equal(read[i]!.length, 200);
      assert.equal(generation.finishReason, "length");
      assert.equal((await sessions[i]!.info()).historyTokens, 40 + 200);
    }
    assert.deepEqual(generations[0]!.tokenIds, await reference(starts[0]!, 200));
  });
});

describe("streaming under backpressure (a server faster than its reader)", () => {
  const EVENTS = 4000;
  const PER_EVENT = 250; // ids up to 1e6: 3-byte varints, about 3 MB in all
  const fake = new FakeRuntime();
  let written = 0;
  let blocked = false;
  let client: Client;

  before(async () => {
    fake.generate = async (call) => {
      for (let event = 0; event < EVENTS && !call.cancelled; event++) {
        const ids = Array.from({ length: PER_EVENT }, (_, i) => event * PER_EVENT + i);
        if (!call.write(tokens(ids))) {
          blocked = true;
          await once(call, "drain");
        }
        written++;
      }
      const usage = { promptTokens: 1, reusedTokens: 0, prefilledTokens: 1, generatedTokens: EVENTS * PER_EVENT };
      call.write({ event: { $case: "finish", value: { reason: FinishReason.FINISH_REASON_LENGTH, usage } } });
      call.end();
    };
    client = new Client(await fake.start());
  });
  after(() => {
    client.close();
    fake.stop();
  });

  it("a reader that stops reading holds the server back, then gets every token in order", async () => {
    const generation = new Session(client, "fake-session").generate();
    const ids = generation[Symbol.asyncIterator]();
    assert.equal((await ids.next()).value, 0);
    let stalledAt = written;
    for (;;) {
      // until the writes stop: flow-control windows and buffers fill, then the server waits for the reader
      await sleep(300);
      if (written === stalledAt) break;
      stalledAt = written;
    }
    assert.ok(blocked && stalledAt < EVENTS / 2, `${stalledAt} of ${EVENTS} events written while nobody read`);

    let expected = 1;
    for (let next = await ids.next(); !next.done; next = await ids.next()) {
      assert.equal(next.value, expected++);
    }
    assert.equal(expected, EVENTS * PER_EVENT);
    assert.equal(written, EVENTS);
    const result = await generation.result();
    assert.equal(result.finishReason, "length");
    assert.equal(result.tokenIds.length, EVENTS * PER_EVENT);
  });
});
