/**
 * One Generate call as its caller sees it (the Python SDK's generation.py and sync.Generation): the token
 * ids as they commit, then the finish reason and usage. Reads pull one event at a time from the call,
 * so a slow reader holds the stream back (gRPC flow control) rather than buffering without bound, and
 * the server sends it fewer, larger chunks.
 */
import { type ClientReadableStream, type StatusObject, status as grpcStatus } from "@grpc/grpc-js";

import type { Session } from "./client.js";
import { CancelledError, FailedPreconditionError, KilnError, NotFoundError } from "./errors.js";
import { type Finish, type GenerateEvent, Usage } from "./gen/kiln/v1/runtime.js";
import { aborted, type Transport } from "./transport.js";
import { type FinishReasonName, finishReason } from "./wire.js";

/** How long a cancel waits for the server to free the session, in milliseconds. */
const CANCEL_WAIT_MS = 10_000;

/** A finished generation, as the in-process API reports it (times as seen by the client, in seconds). */
export interface GenerationResult {
  tokenIds: number[];
  /** Log-probabilities of tokenIds when requested with `logprobs: true`, else null. */
  logprobs: number[] | null;
  finishReason: FinishReasonName;
  usage: Usage;
  /** The stop string that ended the generation, if one did. */
  stopString: string | null;
  timeToFirstTokenS: number | null;
  totalS: number;
}

/**
 * The token ids of one generation as they commit: `for await (const id of generation)`. Afterwards
 * finishReason, usage and result() tell how it went.
 *
 * Leaving early cancels it: `break` out of the loop, call cancel(), or abort the `signal` given to
 * generate(). Each returns (or throws) only once the server has freed the session for its next call, and
 * the tokens committed before the cancel took effect stay in the session's history. A cancel() or a
 * break ends the iteration quietly; an aborted signal makes it throw CancelledError (with the signal's
 * reason as `cause`) after the tokens already received.
 */
export class Generation implements AsyncIterable<number> {
  private readonly pending: number[] = []; // received, not yet handed to the caller
  private readonly received: number[] = [];
  private readonly receivedLogprobs: number[] = [];
  private finish: Finish | undefined;
  private status: StatusObject | undefined; // once the call ended, however it ended
  private cancelled = false; // by this client
  private abortedBy: AbortSignal | undefined;
  private cancelling: Promise<void> | undefined;
  private wake: (() => void) | undefined; // resolves a read waiting for the call
  private readonly acceptance: Promise<void>;
  private readonly startedAt = performance.now();
  private firstTokenAt: number | undefined;
  private endedAt = 0;

  /** @internal Session.generate() makes generations. */
  constructor(
    private readonly session: Session,
    private readonly transport: Transport,
    private readonly call: ClientReadableStream<GenerateEvent> | undefined, // none when `signal` was aborted already
    private readonly signal: AbortSignal | undefined,
  ) {
    if (call === undefined) {
      this.cancelled = true;
      this.abortedBy = signal;
      this.acceptance = Promise.reject(aborted(signal as AbortSignal));
      this.acceptance.catch(() => {});
      return;
    }
    const notify = (): void => {
      const wake = this.wake;
      this.wake = undefined;
      wake?.();
    };
    const onAbort = (): void => {
      if (this.stop()) this.abortedBy = signal;
    };
    call.on("readable", notify);
    call.on("error", () => {}); // the status event carries every failure
    call.on("status", (status: StatusObject) => {
      this.status = status;
      signal?.removeEventListener("abort", onAbort);
      notify();
    });
    this.acceptance = new Promise((resolve, reject) => {
      call.once("metadata", () => resolve());
      call.once("status", (status: StatusObject) =>
        status.code === grpcStatus.OK ? resolve() : reject(this.transport.failure(status, signal)),
      );
    });
    this.acceptance.catch(() => {}); // only a caller of accepted() hears of a refusal there
    if (signal?.aborted) onAbort();
    else signal?.addEventListener("abort", onAbort, { once: true });
  }

  /**
   * Resolves once the server accepted the generation (before its first token), or rejects with its
   * refusal: NotFoundError, DeadlineExceededError when the deadline passed while it waited for its turn
   * (a session runs one generate at a time, in arrival order; a later one waits for those ahead of it), ...
   * Iterating surfaces the same errors; this is for callers that want them before the first token.
   */
  accepted(): Promise<void> {
    return this.acceptance;
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<number, void, undefined> {
    for await (const chunk of this.chunks()) yield* chunk;
  }

  /** Token ids in the groups they arrived in (every token that was ready when the server sent them). */
  async *chunks(): AsyncGenerator<number[], void, undefined> {
    try {
      while (this.pending.length > 0 || (await this.receive())) {
        if (this.pending.length > 0) yield this.pending.splice(0);
      }
      if (this.abortedBy !== undefined) {
        await this.cancelling;
        throw aborted(this.abortedBy);
      }
    } finally {
      await this.cancel(); // a no-op unless the caller left early
    }
  }

  /** Waits for the end and summarises the generation; CancelledError if it was cancelled here. */
  async result(): Promise<GenerationResult> {
    for await (const _ of this.chunks()) {
      // drained: the final event has what result() reports
    }
    const finish = this.finish;
    if (finish === undefined) {
      throw new CancelledError("the generation was cancelled by this client; it has no final accounting");
    }
    return {
      tokenIds: this.tokenIds,
      logprobs: this.logprobs,
      finishReason: finishReason(finish.reason),
      usage: Usage.fromPartial(finish.usage ?? {}),
      stopString: this.stopString,
      timeToFirstTokenS: this.firstTokenAt === undefined ? null : (this.firstTokenAt - this.startedAt) / 1000,
      totalS: (this.endedAt - this.startedAt) / 1000,
    };
  }

  /**
   * Stops the generation and resolves once the server has freed the session for the next call. Tokens
   * generated before the cancel took effect stay in the history (see Session.info()); those already
   * received are still handed out by the iteration. Does nothing once the generation ended.
   */
  cancel(): Promise<void> {
    this.stop();
    return this.cancelling ?? Promise.resolve();
  }

  /** Every token id received so far. */
  get tokenIds(): number[] {
    return [...this.received];
  }

  /** Log-probabilities of tokenIds when requested with `logprobs: true`, else null. */
  get logprobs(): number[] | null {
    return this.receivedLogprobs.length > 0 ? [...this.receivedLogprobs] : null;
  }

  /** "stop" | "length" | "cancelled" once finished; null while running. */
  get finishReason(): FinishReasonName | null {
    if (this.finish !== undefined) return finishReason(this.finish.reason);
    return this.cancelled ? "cancelled" : null;
  }

  /** Token accounting from the server's final event; null while running or after a cancel. */
  get usage(): Usage | null {
    return this.finish === undefined ? null : Usage.fromPartial(this.finish.usage ?? {});
  }

  /** The stop string that ended the generation, if one did. */
  get stopString(): string | null {
    return this.finish?.stopString ?? null;
  }

  /** Nothing more will arrive: the final event came, or this client cancelled. (A failed call throws
   * its error at every read, as it does in the Python SDK.) */
  private get done(): boolean {
    return this.finish !== undefined || this.cancelled;
  }

  /** Cancels a running call and starts waiting for the server to free the session; false if it had ended. */
  private stop(): boolean {
    if (this.done || this.status !== undefined) return false;
    this.cancelled = true;
    this.endedAt = performance.now();
    this.call?.cancel();
    this.cancelling = waitUntilIdle(this.session);
    this.cancelling.catch(() => {}); // an abort nobody iterates must not be an unhandled rejection
    return true;
  }

  /** Reads the next event into the generation; false once nothing more will come. */
  private async receive(): Promise<boolean> {
    if (this.done) return false;
    const event = await this.read();
    if (event === undefined) {
      if (!this.done) throw new KilnError("the server ended the Generate stream without its final event");
      return false;
    }
    if (event.event?.$case === "finish") {
      this.finish = event.event.value;
      this.endedAt = performance.now();
    } else if (event.event?.$case === "tokens") {
      this.firstTokenAt ??= performance.now();
      const { tokenIds, logprobs } = event.event.value;
      this.received.push(...tokenIds);
      this.receivedLogprobs.push(...logprobs);
      this.pending.push(...tokenIds);
    }
    return true;
  }

  /**
   * The next event of the call; undefined once it ended with OK or this client cancelled it. A failed
   * call throws its typed error, a missed deadline at the deadline: the session's next generate waits on
   * the server for the cancelled one to end, so the caller can go on with it at once.
   */
  private async read(): Promise<GenerateEvent | undefined> {
    for (;;) {
      if (this.cancelled || this.call === undefined) return undefined;
      const event = this.call.read() as GenerateEvent | null;
      if (event !== null) return event;
      const status = this.status;
      if (status !== undefined) {
        if (status.code === grpcStatus.OK) return undefined;
        throw this.transport.failure(status, this.signal);
      }
      await new Promise<void>((resolve) => {
        this.wake = resolve;
      });
    }
  }
}

/**
 * Returns once the server has no generate in flight on `session` (or the session is gone), polling its
 * info: briefly at first (a cancel usually takes one engine step), backing off; FailedPreconditionError
 * after CANCEL_WAIT_MS.
 */
async function waitUntilIdle(session: Session): Promise<void> {
  const deadline = Date.now() + CANCEL_WAIT_MS;
  for (let pause = 1; Date.now() < deadline; pause = Math.min(2 * pause, 50)) {
    try {
      if (!(await session.info()).generating) return;
    } catch (error) {
      if (error instanceof NotFoundError) return;
      throw error;
    }
    await new Promise((resolve) => setTimeout(resolve, pause));
  }
  throw new FailedPreconditionError(
    `session ${session.id} still has a generate in flight ${CANCEL_WAIT_MS / 1000} s after cancel`,
  );
}
