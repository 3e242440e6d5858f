/**
 * Bad input against a real `kiln serve`: typed errors before the wire (with the Python SDK's messages)
 * or from the server, and nothing changes on the server. Wrong types are passed as plain JavaScript
 * callers would, past the type checker.
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { Client, InvalidArgumentError, NotFoundError, ResourceExhaustedError, Session } from "@kiln/client";

import { requestsCounted, sharedServers } from "./helpers.js";

const { open } = sharedServers();
const VOCAB = 256; // the tiny model's

/** A value of the wrong type, as plain JavaScript would pass it. */
const untyped = <T>(value: unknown): T => value as T;

describe("bad input", () => {
  let client: Client;
  let session: Session;
  before(async () => {
    client = new Client(open.grpcAddress, { tokenizer: "server" });
    session = await client.createSession({ tokens: [1, 2, 3] });
  });
  after(() => client.close());

  it("anything but integers is refused as token ids before the wire, everywhere ids go", async () => {
    const notIds = [[1.5], [Number.NaN], [Infinity], [[1, 2]], [null], ["1"], "abc", Buffer.from("ab"), 5, { length: 1 }];
    for (const ids of notIds) {
      const calls = [
        () => client.createSession({ tokens: untyped(ids) }),
        () => session.append(untyped(ids)),
        () => client.detokenize(untyped(ids)),
        async () => session.generate({ stopTokenIds: untyped(ids) }),
      ];
      for (const call of calls) {
        await assert.rejects(call(), {
          name: "InvalidArgumentError",
          message: /^token ids must be an iterable of integers, got /,
        });
      }
    }
  });

  it("ids the int32 wire field cannot carry are refused before the wire, as the Python SDK does", async () => {
    await assert.rejects(client.createSession({ tokens: [2 ** 40] }), {
      message: "token_ids=[1099511627776]: Value out of range: 1099511627776",
    });
    await assert.rejects(session.append([1, -(2 ** 40)]), { message: /Value out of range: -1099511627776$/ });
  });

  it("negative ids, ids past the vocabulary and an empty append are refused by the server", async () => {
    const outside = /^token ids must be integers in \[0, 256\); got /;
    await assert.rejects(client.createSession({ tokens: [-1] }), { name: "InvalidArgumentError", message: outside });
    await assert.rejects(client.createSession({ tokens: [VOCAB] }), { name: "InvalidArgumentError", message: outside });
    await assert.rejects(session.append([1, VOCAB + 5]), { name: "InvalidArgumentError", message: outside });
    await assert.rejects(client.detokenize([VOCAB]), InvalidArgumentError);
    await assert.rejects(session.append([]), { name: "InvalidArgumentError", message: "append needs at least one token id" });
    await assert.rejects(session.append(new Uint32Array(0)), InvalidArgumentError);
  });

  it("bad parameters are InvalidArgumentError and change nothing", async () => {
    const before = await requestsCounted(open, "grpc/CreateSession", "INVALID_ARGUMENT");
    const badCalls = [
      () => client.createSession({ tokens: [1], ttlS: 0 }),
      () => client.createSession({ tokens: [1], ttlS: 1e-300 }), // would expire before the reply
      () => client.createSession({ tokens: [1], ttlS: 1e12 }),
      () => session.generate({ maxTokens: 0 }).result(),
      () => session.generate({ maxTokens: -5 }).result(),
      () => session.generate({ maxTokens: 10 ** 6 }).result(),
      () => session.generate({ maxTokens: 4, temperature: -1 }).result(),
      () => session.generate({ maxTokens: 4, topP: 2 }).result(),
      () => session.generate({ maxTokens: 4, topK: -1 }).result(),
      () => session.generate({ maxTokens: 4, minP: 1.5 }).result(),
      () => session.generate({ maxTokens: 4, repetitionPenalty: 0 }).result(),
      () => session.generate({ maxTokens: 4, presencePenalty: 2.5 }).result(),
      () => session.generate({ maxTokens: 4, frequencyPenalty: -3 }).result(),
      () => session.generate({ maxTokens: 4, stopTokenIds: [VOCAB] }).result(),
      () => session.generate({ maxTokens: 4, stop: ["x".repeat(1000)] }).result(),
      () => session.fork({ at: -1 }),
      () => session.fork({ at: 4 }),
      () => client.getSession(""),
      () => client.getSession("x".repeat(1000)),
    ];
    for (const call of badCalls) await assert.rejects(call(), InvalidArgumentError);
    for (const field of ["min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]) {
      const option = field.replace(/_(.)/g, (_, letter: string) => letter.toUpperCase());
      await assert.rejects(session.generate({ maxTokens: 4, [option]: 101 }).result(), { name: "InvalidArgumentError", message: new RegExp(field) });
    }
    assert.equal((await session.info()).historyTokens, 3); // nothing was half-applied
    assert.equal((await session.generate({ maxTokens: 2, ignoreEos: true }).result()).usage.generatedTokens, 2);
    assert.ok((await requestsCounted(open, "grpc/CreateSession", "INVALID_ARGUMENT")) >= before + 3);
  });

  it("options of the wrong type are refused before the wire, naming the option", async () => {
    const cases: [Record<string, unknown>, RegExp][] = [
      [{ maxTokens: "3" }, /^maxTokens='3': must be an integer$/],
      [{ maxTokens: 2.5 }, /^maxTokens=2.5: must be an integer$/],
      [{ maxTokens: 2 ** 40 }, /^maxTokens=1099511627776: Value out of range: 1099511627776$/],
      [{ temperature: "hot" }, /^temperature='hot': must be a number$/],
      [{ topP: "x" }, /^topP/],
      [{ topK: 1.5 }, /^topK/],
      [{ minP: "0.1" }, /^minP='0.1': must be a number$/],
      [{ repetitionPenalty: true }, /^repetitionPenalty/],
      [{ presencePenalty: "1" }, /^presencePenalty/],
      [{ frequencyPenalty: null }, /^frequencyPenalty/],
      [{ seed: "s" }, /^seed/],
      [{ seed: -1 }, /^seed=-1: Value out of range: -1$/],
      [{ ignoreEos: "yes" }, /^ignoreEos/],
      [{ logprobs: 1 }, /^logprobs/],
      [{ stop: 5 }, /^stop must be a string or an iterable of strings, got 5$/],
      [{ stop: [1] }, /^stop must be/],
      [{ stop: ["a", null] }, /^stop must be/],
      [{ timeoutMs: "soon" }, /^timeoutMs/],
    ];
    for (const [options, message] of cases) {
      assert.throws(() => session.generate(options), { name: "InvalidArgumentError", message });
      await assert.rejects(session.generateText(options), { name: "InvalidArgumentError", message });
    }
    assert.equal((await session.info()).generating, false);
    const otherCalls = [
      () => session.fork({ at: untyped("1") }),
      () => session.fork({ at: 1.5 }),
      () => client.createSession({ tokens: [1], ttlS: untyped("60") }),
      () => client.tokenize(untyped(5)),
      () => client.tokenize("x", { addSpecialTokens: untyped("no") }),
      () => client.detokenize([1], { skipSpecialTokens: untyped("no") }),
      () => client.getSession(untyped(5)),
      () => session.appendText(untyped(5)),
      () => client.health({ timeoutMs: untyped("1s") }),
    ];
    for (const call of otherCalls) await assert.rejects(call(), InvalidArgumentError);
    assert.throws(() => new Client(open.grpcAddress, { tokenizer: untyped("local") }), {
      name: "InvalidArgumentError",
      message: /^tokenizer must be undefined, "server" or an object with encode\(\) and decode\(\)/,
    });
  });

  it("unknown session ids are NotFoundError", async () => {
    const id = "x".repeat(22);
    await assert.rejects(client.getSession(id), { name: "NotFoundError", message: `session '${id}' does not exist` });
    await assert.rejects(new Session(client, id).generate().accepted(), NotFoundError);
  });

  it("a message over the server's size limit is ResourceExhaustedError and loses nothing", async () => {
    const session = await client.createSession({ tokens: [1, 2, 3] });
    const ids = new Uint32Array(2_500_000).fill(VOCAB - 1); // 2-byte varints (ids >= 128): 5 MB, over 4 MiB
    await assert.rejects(session.append(ids), { name: ResourceExhaustedError.name, message: /larger than max/ });
    assert.equal((await session.info()).historyTokens, 3);
  });
});
