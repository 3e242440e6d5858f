/**
 * One channel to a Kiln server and the calls over it, the same for every method of the Runtime service
 * (the call table is the generated RuntimeService definition, as kiln/v1/rpc.py is for Python): the API
 * key as `authorization` metadata, deadlines, AbortSignals, typed errors. Closing it cancels the calls in
 * flight; their callers then get FailedPreconditionError("the client is closed"), as later calls do.
 */
import * as grpc from "@grpc/grpc-js";

import { CancelledError, clientClosed, errorFor, InvalidArgumentError, KilnError } from "./errors.js";
import { type GenerateEvent, type GenerateRequest, RuntimeService } from "./gen/kiln/v1/runtime.js";
import { channelCredentials, type TlsOptions } from "./tls.js";
import { typed } from "./wire.js";

/** Options every call takes. */
export interface CallOptions {
  /** Cancels the call when aborted; it rejects with CancelledError (for generate, see Generation). */
  signal?: AbortSignal;
  /** Milliseconds the call may take, else DeadlineExceededError; overrides the client's `timeoutMs`. */
  timeoutMs?: number;
}

type Service = typeof RuntimeService;
/** The methods with a single reply: every one but Generate. */
export type UnaryMethod = { [K in keyof Service]: Service[K]["responseStream"] extends false ? K : never }[keyof Service];
type RequestOf<K extends keyof Service> = Parameters<Service[K]["requestSerialize"]>[0];
type ReplyOf<K extends keyof Service> = ReturnType<Service[K]["responseDeserialize"]>;

/** What a finished call reports: grpc-js's ServiceError and StatusObject both have these. */
interface CallStatus {
  code: grpc.status;
  details: string;
}

export class Transport {
  private client: grpc.Client | undefined;
  private readonly metadata: grpc.Metadata;
  private readonly calls = new Set<grpc.Call>();

  /** `timeoutMs` is the default deadline of unary calls; a generate has only its own. `tls`: see tls.ts. */
  constructor(
    address: string,
    apiKey: string | undefined,
    private readonly timeoutMs: number | undefined,
    tls?: boolean | TlsOptions,
  ) {
    typed<string>("address", address, "string");
    typed<number>("timeoutMs", timeoutMs, "number");
    this.metadata = authMetadata(apiKey);
    // a connection of its own (grpc-js shares one per address by default), so that closing this client
    // closes it whatever other clients of the same server do
    this.client = new grpc.Client(address, channelCredentials(tls), { "grpc.use_local_subchannel_pool": 1 });
  }

  unary<K extends UnaryMethod>(method: K, request: RequestOf<K>, options: CallOptions = {}): Promise<ReplyOf<K>> {
    const client = this.open();
    const { signal } = options;
    if (signal?.aborted) return Promise.reject(aborted(signal));
    const { path, requestSerialize, responseDeserialize } = RuntimeService[method] as unknown as grpc.MethodDefinition<
      RequestOf<K>,
      ReplyOf<K>
    >;
    return new Promise((resolve, reject) => {
      const cancel = (): void => call.cancel();
      const call = client.makeUnaryRequest(
        path,
        requestSerialize,
        responseDeserialize,
        request,
        this.metadata.clone(),
        this.callOptions(options.timeoutMs ?? this.timeoutMs),
        (error, reply) => {
          this.calls.delete(call);
          signal?.removeEventListener("abort", cancel);
          if (error) reject(this.failure(error, signal));
          else resolve(reply as ReplyOf<K>);
        },
      );
      this.calls.add(call);
      signal?.addEventListener("abort", cancel, { once: true });
    });
  }

  /** Starts a Generate call; the caller reads it (see Generation) and handles its AbortSignal. */
  generate(request: GenerateRequest, timeoutMs: number | undefined): grpc.ClientReadableStream<GenerateEvent> {
    const client = this.open();
    const { path, requestSerialize, responseDeserialize } = RuntimeService.generate;
    const call = client.makeServerStreamRequest(
      path,
      requestSerialize,
      responseDeserialize,
      request,
      this.metadata.clone(),
      this.callOptions(timeoutMs),
    );
    this.calls.add(call);
    call.on("status", () => this.calls.delete(call));
    return call;
  }

  /**
   * The typed error of a failed call: "the client is closed" when closing the client ended it,
   * CancelledError carrying the signal's reason when its AbortSignal did.
   */
  failure(error: CallStatus, signal?: AbortSignal): KilnError {
    if (this.client === undefined) return clientClosed();
    if (signal?.aborted && error.code === grpc.status.CANCELLED) return aborted(signal);
    return errorFor(error.code, error.details);
  }

  get closed(): boolean {
    return this.client === undefined;
  }

  /** Cancels the calls in flight and closes the channel; closing again does nothing. */
  close(): void {
    const client = this.client;
    this.client = undefined;
    for (const call of this.calls) call.cancel();
    this.calls.clear();
    client?.close();
  }

  private open(): grpc.Client {
    if (this.client === undefined) throw clientClosed();
    return this.client;
  }

  private callOptions(timeoutMs: number | undefined): grpc.CallOptions {
    const checked = typed<number>("timeoutMs", timeoutMs, "number");
    return checked === undefined ? {} : { deadline: Date.now() + checked };
  }
}

export function aborted(signal: AbortSignal): CancelledError {
  return new CancelledError("the call was cancelled by its AbortSignal", { cause: signal.reason });
}

/**
 * The `authorization` header of an API key. A key must be printable ASCII without spaces (what a header
 * value carries and the server compares): anything else is refused when the client is created, rather
 * than failing every call.
 */
function authMetadata(apiKey: string | undefined): grpc.Metadata {
  const metadata = new grpc.Metadata();
  if (apiKey === undefined) return metadata;
  if (typeof apiKey !== "string" || !/^[!-~]+$/.test(apiKey)) {
    throw new InvalidArgumentError("apiKey must be a non-empty string of printable ASCII without spaces");
  }
  metadata.set("authorization", `Bearer ${apiKey}`);
  return metadata;
}
