/**
 * The SDK's surface, method for method the Python SDK's (kiln/client/sync.py and aio.py) with camelCase
 * names: Client -> Session -> Generation, over one gRPC channel.
 *
 *     const client = new Client("127.0.0.1:50051", { apiKey });
 *     const session = await client.createSession({ tokens });
 *     for await (const id of session.generate({ maxTokens: 16 })) { ... }
 *
 * Every failure is a typed error (NotFoundError, InvalidArgumentError, ...; see errors.ts).
 */
import {
  AppendTokensRequest,
  CloseSessionRequest,
  CreateSessionRequest,
  DeleteSnapshotRequest,
  DetokenizeRequest,
  ForkSessionRequest,
  GetSessionInfoRequest,
  HealthRequest,
  ListSessionsRequest,
  ListSnapshotsRequest,
  RestoreSessionRequest,
  type SessionInfo,
  SnapshotSessionRequest,
  type SnapshotInfo,
  TokenizeRequest,
} from "./gen/kiln/v1/runtime.js";
import { Generation } from "./generation.js";
import { TextAssembler, TextGeneration } from "./text.js";
import { optIn, requireTokenizer, SERVER, type TokenizerOption } from "./tokenizer.js";
import type { TlsOptions } from "./tls.js";
import { type CallOptions, Transport } from "./transport.js";
import {
  generateRequest,
  type Health,
  health,
  integer,
  type SamplingOptions,
  sessionOf,
  snapshotOf,
  stopStrings,
  type TokenIds,
  tokenIds,
  typed,
  UINT32,
} from "./wire.js";

export interface ClientOptions {
  /** Sent as `authorization: Bearer <key>`. A session is visible only to the key that created it. */
  apiKey?: string;
  /**
   * Opts in to the text helpers (appendText, generateText): "server" for the server's tokenizer, or a
   * local one. By default the client deals in token ids only.
   */
  tokenizer?: TokenizerOption;
  /** Default deadline of every call but generate, in milliseconds. Unset: none. */
  timeoutMs?: number;
  /**
   * TLS, for a server started with --tls-cert: `true` trusts the system's roots, `{ ca }` that CA (PEM);
   * `cert` + `key` (PEM) present a client certificate, for --tls-client-ca. Unset or false: plaintext.
   */
  tls?: boolean | TlsOptions;
}

export interface CreateSessionOptions extends CallOptions {
  /** The initial history; may be empty. */
  tokens?: TokenIds;
  /** Idle seconds before the server evicts the session, in [1, 30 days]. Unset: the server's default. */
  ttlS?: number;
  /**
   * KV policy for the session's whole life: "full" (exact, memory grows), "sink_window" (bounded,
   * forgets the middle), "restore" (bounded and exact: evicted K/V in the server's tiers). Unset: the server's.
   */
  kvPolicy?: "full" | "sink_window" | "restore";
  /** Tokens at the start of the history kept resident (sink_window, restore). Unset: the server's. */
  kvSinkTokens?: number;
  /** Most recent tokens kept resident (sink_window, restore). Unset: the server's. */
  kvWindowTokens?: number;
}

export interface GenerateOptions extends SamplingOptions, CallOptions {}

/** A connection to a Kiln server. Sessions outlive it: their ids work from any later client. */
export class Client {
  readonly address: string;
  readonly tokenizer: TokenizerOption | undefined;
  /** @internal */
  readonly _transport: Transport;

  constructor(address: string, options: ClientOptions = {}) {
    this.address = address;
    this.tokenizer = optIn(options.tokenizer);
    this._transport = new Transport(address, options.apiKey, options.timeoutMs, options.tls);
  }

  /** A new session with an optional initial history and idle TTL. */
  async createSession(options: CreateSessionOptions = {}): Promise<Session> {
    const request = CreateSessionRequest.fromPartial({
      tokenIds: tokenIds(options.tokens),
      ttlS: typed<number>("ttlS", options.ttlS, "number"),
      kvPolicy: typed<string>("kvPolicy", options.kvPolicy, "string"),
      kvSinkTokens: integer("kvSinkTokens", options.kvSinkTokens, UINT32),
      kvWindowTokens: integer("kvWindowTokens", options.kvWindowTokens, UINT32),
    });
    return new Session(this, sessionOf(await this._transport.unary("createSession", request, options)).sessionId);
  }

  /** Reattaches to a session by id (e.g. after this process restarted); NotFoundError if it is gone. */
  async getSession(sessionId: string, options: CallOptions = {}): Promise<Session> {
    const request = GetSessionInfoRequest.fromPartial({ sessionId: typed<string>("sessionId", sessionId, "string") });
    await this._transport.unary("getSessionInfo", request, options);
    return new Session(this, sessionId);
  }

  /**
   * This API key's sessions: those in memory, least recently used first, then (on a server that persists
   * sessions) those saved but not in memory, `resident` false, brought back by their next use.
   */
  async listSessions(options: CallOptions = {}): Promise<SessionInfo[]> {
    const reply = await this._transport.unary("listSessions", ListSessionsRequest.fromPartial({}), options);
    return reply.sessions.map((session) => ({ ...session }));
  }

  /**
   * A new session with a snapshot's history and K/V. FailedPreconditionError if it fails verification
   * (another model or KV format, a corrupt page); NotFoundError if it is unknown or another key's.
   */
  async restoreSession(snapshotId: string, options: CallOptions = {}): Promise<Session> {
    const request = RestoreSessionRequest.fromPartial({ snapshotId: typed<string>("snapshotId", snapshotId, "string") });
    return new Session(this, sessionOf(await this._transport.unary("restoreSession", request, options)).sessionId);
  }

  /** This API key's checkpoints, oldest first. */
  async listSnapshots(options: CallOptions = {}): Promise<SnapshotInfo[]> {
    const reply = await this._transport.unary("listSnapshots", ListSnapshotsRequest.fromPartial({}), options);
    return reply.snapshots.map((snapshot) => ({ ...snapshot }));
  }

  /** Deletes a checkpoint; NotFoundError if it is unknown or another key's. */
  async deleteSnapshot(snapshotId: string, options: CallOptions = {}): Promise<void> {
    const request = DeleteSnapshotRequest.fromPartial({ snapshotId: typed<string>("snapshotId", snapshotId, "string") });
    await this._transport.unary("deleteSnapshot", request, options);
  }

  /** Token ids of `text` by the server's tokenizer. */
  async tokenize(text: string, options: { addSpecialTokens?: boolean } & CallOptions = {}): Promise<number[]> {
    const request = TokenizeRequest.fromPartial({
      text: typed<string>("text", text, "string"),
      addSpecialTokens: typed<boolean>("addSpecialTokens", options.addSpecialTokens, "boolean") ?? false,
    });
    return (await this._transport.unary("tokenize", request, options)).tokenIds;
  }

  /** Text of token ids by the server's tokenizer. */
  async detokenize(ids: TokenIds, options: { skipSpecialTokens?: boolean } & CallOptions = {}): Promise<string> {
    const request = DetokenizeRequest.fromPartial({
      tokenIds: tokenIds(ids),
      skipSpecialTokens: typed<boolean>("skipSpecialTokens", options.skipSpecialTokens, "boolean") ?? false,
    });
    return (await this._transport.unary("detokenize", request, options)).text;
  }

  /** What the server serves (vocabSize: token ids are valid in [0, vocabSize)) and how full its KV cache is. */
  async health(options: CallOptions = {}): Promise<Health> {
    return health(await this._transport.unary("health", HealthRequest.fromPartial({}), options));
  }

  /**
   * Closes the channel and cancels the calls in flight; they and later calls throw
   * FailedPreconditionError. Sessions live on in the server until closed or evicted.
   */
  close(): void {
    this._transport.close();
  }

  /** @internal Token ids of text by the opted-in tokenizer. */
  async _encode(text: string, addSpecialTokens: boolean): Promise<number[]> {
    const tokenizer = requireTokenizer(this.tokenizer, "appendText");
    if (tokenizer === SERVER) return this.tokenize(text, { addSpecialTokens });
    return tokenIds(await tokenizer.encode(text, addSpecialTokens));
  }

  /** @internal Text of generated ids by the opted-in tokenizer (special tokens left out). */
  async _decode(ids: number[]): Promise<string> {
    const tokenizer = requireTokenizer(this.tokenizer, "generateText");
    if (tokenizer === SERVER) return this.detokenize(ids, { skipSpecialTokens: true });
    return tokenizer.decode(ids, true);
  }
}

/**
 * One server session, by id (`session.id`): an append-only history of token ids whose K/V the server
 * keeps between calls. `new Session(client, id)` makes a handle without asking the server;
 * client.getSession(id) checks that the session exists.
 */
export class Session {
  constructor(
    readonly client: Client,
    readonly id: string,
  ) {}

  /** Appends to the history (computed by the next generate); returns the session after it. */
  async append(ids: TokenIds, options: CallOptions = {}): Promise<SessionInfo> {
    const request = AppendTokensRequest.fromPartial({ sessionId: this.id, tokenIds: tokenIds(ids) });
    return sessionOf(await this.client._transport.unary("appendTokens", request, options));
  }

  /**
   * Tokenizes with the client's opted-in tokenizer (special tokens such as BOS only at the very start of
   * a history) and appends.
   */
  async appendText(text: string, options: CallOptions = {}): Promise<SessionInfo> {
    typed<string>("text", text, "string");
    const first = (await this.info(options)).historyTokens === 0;
    return this.append(await this.client._encode(text, first), options);
  }

  /**
   * Continues the history: token ids as they commit (see Generation). A generate behind another on the
   * session waits its turn on the server (within `timeoutMs`). Bad options throw here; the server's
   * refusals (an unknown session, a deadline passed while waiting) come from the first read, or from
   * `accepted()`.
   */
  generate(options: GenerateOptions = {}): Generation {
    const request = generateRequest(this.id, options);
    const transport = this.client._transport;
    const call = options.signal?.aborted ? undefined : transport.generate(request, options.timeoutMs); // as unary calls
    return new Generation(this, transport, call, options.signal);
  }

  /**
   * Like generate() (same options), as text: iterate for the pieces as they become final, or await the
   * whole reply (see TextGeneration). Needs the client's opted-in tokenizer.
   */
  generateText(options: GenerateOptions = {}): TextGeneration {
    return new TextGeneration(this.textPieces(options));
  }

  /** A new session sharing the first `at` tokens (unset: all) of this history, and their K/V. */
  async fork(options: { at?: number } & CallOptions = {}): Promise<Session> {
    const request = ForkSessionRequest.fromPartial({ sessionId: this.id, at: integer("at", options.at) });
    return new Session(this.client, sessionOf(await this.client._transport.unary("forkSession", request, options)).sessionId);
  }

  /** Saves this (idle) session as a checkpoint; resolves to its id once it is durable. */
  async snapshot(options: CallOptions = {}): Promise<string> {
    const request = SnapshotSessionRequest.fromPartial({ sessionId: this.id });
    return snapshotOf(await this.client._transport.unary("snapshotSession", request, options)).snapshotId;
  }

  /** Lengths, residency and the last generate's reuse. */
  async info(options: CallOptions = {}): Promise<SessionInfo> {
    const request = GetSessionInfoRequest.fromPartial({ sessionId: this.id });
    return sessionOf(await this.client._transport.unary("getSessionInfo", request, options));
  }

  /** Ends the session and frees its K/V; later calls on it throw NotFoundError. */
  async close(options: CallOptions = {}): Promise<void> {
    const request = CloseSessionRequest.fromPartial({ sessionId: this.id });
    await this.client._transport.unary("closeSession", request, options);
  }

  private async *textPieces(options: GenerateOptions): AsyncGenerator<string, void, undefined> {
    requireTokenizer(this.client.tokenizer, "generateText");
    const assembler = new TextAssembler(stopStrings(options.stop));
    const generation = this.generate(options);
    try {
      for await (const chunk of generation.chunks()) {
        assembler.add(chunk);
        for (let ids = assembler.toDecode(); ids !== null; ids = assembler.toDecode()) {
          const piece = assembler.decoded(await this.client._decode(ids));
          if (piece) yield piece;
        }
      }
      const rest = assembler.finish(generation.stopString);
      if (rest) yield rest;
    } finally {
      await generation.cancel(); // a no-op unless the caller left early
    }
  }
}
