/**
 * Against a stand-in server (test/fake-runtime.ts): typed errors for every gRPC status, the edges of a
 * Generate stream, and what a generate puts on the wire. Kiln itself never answers PERMISSION_DENIED or
 * ends a stream without its final event, but the SDK must still say what happened; the same errors
 * from the real server are in the other test files.
 */
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import * as grpc from "@grpc/grpc-js";
import {
  CancelledError,
  Client,
  DeadlineExceededError,
  FailedPreconditionError,
  InvalidArgumentError,
  KilnError,
  NotFoundError,
  PermissionDeniedError,
  ResourceExhaustedError,
  Session,
  UnauthenticatedError,
  UnavailableError,
} from "@kiln/client";

import { FinishReason, type GenerateRequest } from "../dist/esm/gen/kiln/v1/runtime.js";
import { FakeRuntime, fail, tokens } from "./fake-runtime.js";
import { freePort, rejection } from "./helpers.js";

async function collect<T>(items: AsyncIterable<T>, into: T[] = []): Promise<T[]> {
  for await (const item of items) into.push(item);
  return into;
}

const TYPED: [keyof typeof grpc.status, typeof KilnError][] = [
  ["INVALID_ARGUMENT", InvalidArgumentError],
  ["NOT_FOUND", NotFoundError],
  ["FAILED_PRECONDITION", FailedPreconditionError],
  ["RESOURCE_EXHAUSTED", ResourceExhaustedError],
  ["UNAUTHENTICATED", UnauthenticatedError],
  ["PERMISSION_DENIED", PermissionDeniedError],
  ["CANCELLED", CancelledError],
  ["UNAVAILABLE", UnavailableError],
  ["DEADLINE_EXCEEDED", DeadlineExceededError],
];

describe("a stand-in server: typed errors, stream edges, requests", () => {
  const fake = new FakeRuntime();
  let client: Client;
  let session: Session;

  before(async () => {
    client = new Client(await fake.start());
    session = new Session(client, "fake-session");
  });
  after(() => {
    client.close();
    fake.stop();
  });

  it("a status with a class of its own is that class, with the server's message", async () => {
    for (const [name, Typed] of TYPED) {
      fake.failure = { code: grpc.status[name], details: `the server says ${name}` };
      const error = await rejection(client.health());
      assert.ok(error instanceof Typed && error instanceof KilnError && error instanceof Error, name);
      assert.equal(error.code, name);
      assert.equal(error.name, Typed.name);
      assert.equal(error.message, `the server says ${name}`);
    }
    fake.failure = undefined;
  });

  it("other statuses are a KilnError whose code names the status", async () => {
    for (const name of ["INTERNAL", "UNKNOWN", "ABORTED", "DATA_LOSS"] as const) {
      fake.failure = { code: grpc.status[name], details: "secret-free summary" };
      await assert.rejects(client.health(), (error: KilnError) => {
        assert.equal(error.constructor, KilnError);
        assert.equal(error.code, name);
        assert.equal(error.message, `${name}: secret-free summary`);
        return true;
      });
    }
    fake.failure = undefined;
    await assert.rejects(client.listSessions(), { code: "UNIMPLEMENTED" });
  });

  it("a reply becomes plain records with string enums", async () => {
    const health = await client.health();
    assert.equal(health.status, "shutting_down");
    assert.equal(health.vocabSize, 256);
    assert.equal((await session.info()).historyTokens, 3);
    assert.equal((await client.createSession()).id, "fake-session");
  });

  it("a refused generate rejects accepted() and every read with its typed error", async () => {
    fake.generate = (call) => fail(call, { code: grpc.status.FAILED_PRECONDITION, details: "already in flight" });
    const generation = session.generate();
    await assert.rejects(generation.accepted(), FailedPreconditionError);
    await assert.rejects(collect(generation), { name: "FailedPreconditionError", message: "already in flight" });
    await assert.rejects(generation.result(), FailedPreconditionError);
    assert.equal(generation.finishReason, null);
  });

  it("accepted() resolves before the first token; the final event has reason, usage, stop string, logprobs", async () => {
    let release = (): void => {};
    const released = new Promise<void>((resolve) => (release = resolve));
    fake.generate = (call) => {
      call.sendMetadata(new grpc.Metadata());
      void released.then(() => {
        call.write(tokens([5, 6], [-0.5, -1.5]));
        call.write(tokens([7], [-2]));
        call.write({
          event: {
            $case: "finish",
            value: {
              reason: FinishReason.FINISH_REASON_STOP,
              usage: { promptTokens: 3, reusedTokens: 1, prefilledTokens: 2, generatedTokens: 3 },
              stopString: "\n\n",
            },
          },
        });
        call.end();
      });
    };
    const generation = session.generate({ logprobs: true });
    await generation.accepted();
    assert.deepEqual(generation.tokenIds, []);
    release();
    const result = await generation.result();
    assert.deepEqual(result.tokenIds, [5, 6, 7]);
    assert.deepEqual(result.logprobs, [-0.5, -1.5, -2]);
    assert.equal(result.finishReason, "stop");
    assert.deepEqual(result.usage, { promptTokens: 3, reusedTokens: 1, prefilledTokens: 2, generatedTokens: 3 });
    assert.equal(result.stopString, "\n\n");
    assert.ok(result.timeToFirstTokenS !== null && result.timeToFirstTokenS >= 0 && result.totalS >= result.timeToFirstTokenS);
    assert.equal(generation.finishReason, "stop");
  });

  it("an error after some tokens comes after them", async () => {
    fake.generate = (call) => {
      call.write(tokens([1, 2]));
      setTimeout(() => fail(call, { code: grpc.status.UNAVAILABLE, details: "the server is shutting down" }), 20);
    };
    const generation = session.generate();
    const seen: number[] = [];
    await assert.rejects(collect(generation, seen), UnavailableError);
    assert.deepEqual(seen, [1, 2]);
    assert.deepEqual(generation.tokenIds, [1, 2]);
  });

  it("a stream that ends without its final event is a KilnError", async () => {
    fake.generate = (call) => {
      call.write(tokens([1]));
      call.end();
    };
    await assert.rejects(session.generate().result(), {
      name: "KilnError",
      message: "the server ended the Generate stream without its final event",
    });
  });

  it("generate options reach the wire as the proto names them; the AbortSignal and deadline stay here", async () => {
    let received: GenerateRequest | undefined;
    fake.generate = (call) => {
      received = call.request;
      call.end();
    };
    const schema = { type: "object", properties: { city: { type: "string" } }, required: ["city"] };
    const options = {
      maxTokens: 7, temperature: 0.5, topP: 0.9, topK: 40, seed: 2 ** 40, stop: "\n\n", logprobs: true,
      minP: 0.05, repetitionPenalty: 1.3, presencePenalty: -0.5, frequencyPenalty: 2,
    };
    await assert.rejects(session.generate({ ...options, stopTokenIds: Uint32Array.of(9), ignoreEos: true, jsonSchema: schema, timeoutMs: 5000 }).result());
    assert.deepEqual(received, {
      sessionId: "fake-session",
      ...options,
      stop: ["\n\n"],
      stopTokenIds: [9],
      ignoreEos: true,
      jsonSchema: JSON.stringify(schema),
      regex: undefined,
      grammar: undefined,
    });
    await assert.rejects(session.generate({ regex: "(yes|no)", grammar: "start: /x/" }).result());
    assert.equal(received?.regex, "(yes|no)");
    assert.equal(received?.grammar, "start: /x/");
    assert.equal(received?.temperature, 0, "greedy unless asked otherwise, as in the Python SDK");
    await assert.rejects(session.generate({ jsonSchema: '{"type": "string"}' }).result());
    assert.equal(received?.jsonSchema, '{"type": "string"}');
    const circular: Record<string, unknown> = {};
    circular.self = circular;
    assert.throws(() => session.generate({ jsonSchema: circular }), {
      name: "InvalidArgumentError",
      message: /^jsonSchema must be JSON-serialisable: /,
    });
  });

  it("a passed deadline is DeadlineExceededError, per call or by the client's default", async () => {
    fake.hang = true;
    try {
      await assert.rejects(client.health({ timeoutMs: 50 }), DeadlineExceededError);
      const impatient = new Client(client.address, { timeoutMs: 50 });
      await assert.rejects(impatient.health(), DeadlineExceededError);
      impatient.close();
    } finally {
      fake.hang = false;
    }
  });

  it("an AbortSignal cancels a call in flight, with its reason as the cause", async () => {
    fake.hang = true;
    try {
      const abort = new AbortController();
      const call = client.health({ signal: abort.signal });
      setTimeout(() => abort.abort("user pressed stop"), 20);
      await assert.rejects(call, (error: CancelledError) => {
        assert.ok(error instanceof CancelledError);
        assert.equal(error.cause, "user pressed stop");
        return true;
      });
      await assert.rejects(client.health({ signal: AbortSignal.abort() }), CancelledError);
    } finally {
      fake.hang = false;
    }
  });

  it("an unreachable server is UnavailableError", async () => {
    const nowhere = new Client(`127.0.0.1:${await freePort()}`);
    await assert.rejects(nowhere.health(), UnavailableError);
    nowhere.close();
  });
});
