/**
 * A stand-in Runtime server (grpc-js, the generated service definition) whose replies each test
 * scripts, for what Kiln itself never does: answer PERMISSION_DENIED, end a stream without its final
 * event, or stream faster than any reader.
 */
import * as grpc from "@grpc/grpc-js";

import {
  type GenerateEvent,
  type GenerateRequest,
  HealthResponse,
  RuntimeService,
  ServingStatus,
  SessionInfo,
} from "../dist/esm/gen/kiln/v1/runtime.js";
import { freePort } from "./helpers.js";

export type Failure = { code: grpc.status; details: string };
export type GenerateCall = grpc.ServerWritableStream<GenerateRequest, GenerateEvent>;

/**
 * Health, GetSessionInfo (never generating, so a cancel returns at once) and CreateSession answer, or
 * fail with `failure`, or never answer while `hang` is set; Generate runs `generate`. Other methods are
 * left unimplemented.
 */
export class FakeRuntime {
  failure: Failure | undefined;
  hang = false;
  generate: (call: GenerateCall) => void = (call) => call.end();
  private readonly server = new grpc.Server();

  async start(): Promise<string> {
    const answer =
      (reply: (request: { sessionId?: string }) => unknown) =>
      (call: grpc.ServerUnaryCall<{ sessionId?: string }, unknown>, callback: grpc.sendUnaryData<unknown>): void => {
        if (this.hang) return;
        if (this.failure) callback(this.failure);
        else callback(null, reply(call.request));
      };
    const session = (request: { sessionId?: string }): unknown => ({
      session: SessionInfo.fromPartial({ sessionId: request.sessionId || "fake-session", historyTokens: 3 }),
    });
    this.server.addService(RuntimeService, {
      health: answer(() =>
        HealthResponse.fromPartial({ status: ServingStatus.SERVING_STATUS_SHUTTING_DOWN, model: "fake", vocabSize: 256 }),
      ),
      getSessionInfo: answer(session),
      createSession: answer(session),
      generate: (call: GenerateCall) => this.generate(call),
    });
    const address = `127.0.0.1:${await freePort()}`;
    await new Promise<number>((resolve, reject) =>
      this.server.bindAsync(address, grpc.ServerCredentials.createInsecure(), (error, port) =>
        error ? reject(error) : resolve(port),
      ),
    );
    return address;
  }

  stop(): void {
    this.server.forceShutdown();
  }
}

export function tokens(tokenIds: number[], logprobs: number[] = []): GenerateEvent {
  return { event: { $case: "tokens", value: { tokenIds, logprobs } } };
}

export function fail(call: GenerateCall, failure: Failure): void {
  call.emit("error", failure);
}
