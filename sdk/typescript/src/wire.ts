/**
 * Between JavaScript values and kiln.v1 messages (the Python SDK's wire.py). Requests are built here, and
 * anything the wire types cannot carry is refused as InvalidArgumentError before a call is made, naming
 * the option: callers from plain JavaScript get no type checks, and the protobuf writer would otherwise
 * wrap or truncate numbers silently. Replies become plain records with string enums.
 */
import { inspect } from "node:util";

import { InvalidArgumentError, KilnError } from "./errors.js";
import {
  FinishReason,
  GenerateRequest,
  type HealthResponse,
  ServingStatus,
  type SessionInfo,
  type SnapshotInfo,
} from "./gen/kiln/v1/runtime.js";

/** Token ids: any iterable of integers, e.g. `number[]`, `Uint32Array` or `Int32Array`. */
export type TokenIds = Iterable<number>;

/** Why a generation ended: an end-of-sequence id, stop token or stop string; max tokens or a full context; a cancel. */
export type FinishReasonName = "stop" | "length" | "cancelled" | "unspecified" | "unrecognized";

/** Whether the server admits work: "serving", "shutting_down" (new work gets UnavailableError), "engine_failed". */
export type ServingStatusName = "serving" | "shutting_down" | "engine_failed" | "unspecified" | "unrecognized";

/** What the server serves and how full its KV cache is (HealthResponse in the proto). */
export interface Health extends Omit<HealthResponse, "status"> {
  status: ServingStatusName;
}

/** How to continue a session; unset options take the server's defaults (see GenerateRequest in the proto). */
export interface SamplingOptions {
  /** Most tokens to generate, >= 1. Unset: the server's default (256). */
  maxTokens?: number;
  /** 0 (the default) is greedy. */
  temperature?: number;
  topP?: number;
  /** Keep only the k most likely tokens; 0: no cut. */
  topK?: number;
  /** In [0, 1]: keep only tokens at least minP times as likely as the likeliest. Unset or 0: no cut. */
  minP?: number;
  /**
   * HF/vLLM's, in (0, 100]: tokens already in the history (earlier turns included) or the reply have
   * their logit divided by it when positive, multiplied otherwise. Unset: 1 (off).
   */
  repetitionPenalty?: number;
  /** OpenAI's, in [-2, 2]: subtracted from the logit of every token the reply already holds. Unset: 0. */
  presencePenalty?: number;
  /** OpenAI's, in [-2, 2]: subtracted from a token's logit per time the reply already holds it. Unset: 0. */
  frequencyPenalty?: number;
  /** Reproducible sampling, independent of whatever else shares the batch. */
  seed?: number;
  /** Stop once the generated text contains one of these (the matching tokens stay in the history). */
  stop?: string | Iterable<string>;
  /** Stop after generating one of these ids (besides the model's end-of-sequence ids). */
  stopTokenIds?: TokenIds;
  ignoreEos?: boolean;
  /** Report each token's log-probability (Generation.logprobs). */
  logprobs?: boolean;
  /**
   * Structured output: at most one of jsonSchema (an object, or JSON text), regex and grammar (Lark,
   * llguidance's dialect) constrains the generated text, for this generate only. A constraint that does
   * not compile is InvalidArgumentError before anything runs.
   */
  jsonSchema?: object | string;
  regex?: string;
  grammar?: string;
}

const INT32 = [-(2 ** 31), 2 ** 31 - 1] as const;
export const UINT32 = [0, 2 ** 32 - 1] as const;
const UINT64 = [0, Number.MAX_SAFE_INTEGER] as const; // the generated code carries uint64 as a number

/** A value as error messages show it: one line, at most 80 characters, arrays as Python shows lists. */
export function shown(value: unknown): string {
  const items = Array.isArray(value) || ArrayBuffer.isView(value) ? (value as ArrayLike<unknown>) : undefined;
  const text =
    items === undefined
      ? inspect(value, { breakLength: Infinity, maxStringLength: 80 })
      : `[${Array.prototype.slice.call(items, 0, 40).map(shown).join(", ")}${items.length > 40 ? ", ..." : ""}]`;
  return text.slice(0, 80);
}

/**
 * Token ids as a fresh array. Anything but integers is refused (a string, which JavaScript would iterate
 * character by character, included), and so is an integer the int32 wire field cannot carry.
 */
export function tokenIds(ids: TokenIds | null | undefined): number[] {
  if (ids === undefined || ids === null) return [];
  const items = iterableItems(ids);
  if (items === undefined || !items.every(Number.isInteger)) {
    throw new InvalidArgumentError(`token ids must be an iterable of integers, got ${shown(ids)}`);
  }
  const outside = items.find((id) => id < INT32[0] || id > INT32[1]);
  if (outside !== undefined) {
    throw new InvalidArgumentError(`token_ids=${shown(ids)}: Value out of range: ${outside}`);
  }
  return items;
}

/** A string is one stop string; otherwise an iterable of them. */
export function stopStrings(stop: string | Iterable<string> | null | undefined): string[] {
  if (stop === undefined || stop === null) return [];
  if (typeof stop === "string") return [stop];
  const items = iterableItems(stop);
  if (items === undefined || !items.every((item) => typeof item === "string")) {
    throw new InvalidArgumentError(`stop must be a string or an iterable of strings, got ${shown(stop)}`);
  }
  return items;
}

/** The items of an iterable that is not a string nor raw bytes; undefined for anything else. */
function iterableItems<T>(values: Iterable<T>): T[] | undefined {
  const iterable = typeof values === "object" && values !== null && Symbol.iterator in values;
  return iterable && !Buffer.isBuffer(values) ? Array.from(values) : undefined;
}

/** An optional integer option within the range of its wire type. */
export function integer(name: string, value: unknown, [min, max]: readonly [number, number] = INT32): number | undefined {
  if (value === undefined) return undefined;
  if (!Number.isInteger(value)) throw new InvalidArgumentError(`${name}=${shown(value)}: must be an integer`);
  const checked = value as number;
  if (checked < min || checked > max) {
    throw new InvalidArgumentError(`${name}=${shown(value)}: Value out of range: ${checked}`);
  }
  return checked;
}

/** An optional option of a primitive type ("number", "boolean", "string"). */
export function typed<T extends number | boolean | string>(
  name: string,
  value: unknown,
  type: "number" | "boolean" | "string",
): T | undefined {
  if (value === undefined || typeof value === type) return value as T | undefined;
  throw new InvalidArgumentError(`${name}=${shown(value)}: must be a ${type}`);
}

export function generateRequest(sessionId: string, options: SamplingOptions): GenerateRequest {
  return GenerateRequest.fromPartial({
    sessionId,
    maxTokens: integer("maxTokens", options.maxTokens),
    temperature: typed<number>("temperature", options.temperature ?? 0, "number"),
    topP: typed<number>("topP", options.topP, "number"),
    topK: integer("topK", options.topK),
    minP: typed<number>("minP", options.minP, "number"),
    repetitionPenalty: typed<number>("repetitionPenalty", options.repetitionPenalty, "number"),
    presencePenalty: typed<number>("presencePenalty", options.presencePenalty, "number"),
    frequencyPenalty: typed<number>("frequencyPenalty", options.frequencyPenalty, "number"),
    seed: integer("seed", options.seed, UINT64),
    stop: stopStrings(options.stop),
    stopTokenIds: tokenIds(options.stopTokenIds),
    ignoreEos: typed<boolean>("ignoreEos", options.ignoreEos, "boolean") ?? false,
    logprobs: typed<boolean>("logprobs", options.logprobs, "boolean") ?? false,
    jsonSchema: schemaText(options.jsonSchema),
    regex: typed<string>("regex", options.regex, "string"),
    grammar: typed<string>("grammar", options.grammar, "string"),
  });
}

/** A JSON schema as the wire carries it: JSON text (a string is taken to be JSON text already). */
function schemaText(schema: unknown): string | undefined {
  if (schema === undefined || typeof schema === "string") return schema;
  let text: string | undefined;
  try {
    text = JSON.stringify(schema);
  } catch (error) {
    throw new InvalidArgumentError(`jsonSchema must be JSON-serialisable: ${(error as Error).message}`);
  }
  if (text === undefined) throw new InvalidArgumentError(`jsonSchema must be JSON-serialisable, got ${shown(schema)}`);
  return text;
}

/** The session a reply carries (every session-returning RPC has one). */
export function sessionOf(reply: { session?: SessionInfo | undefined }): SessionInfo {
  if (reply.session === undefined) throw new KilnError("the server's reply carries no session");
  return { ...reply.session };
}

export function snapshotOf(reply: { snapshot?: SnapshotInfo | undefined }): SnapshotInfo {
  if (reply.snapshot === undefined) throw new KilnError("the server's reply carries no snapshot");
  return { ...reply.snapshot };
}

export function finishReason(reason: FinishReason): FinishReasonName {
  return enumName(FinishReason, reason, "FINISH_REASON_") as FinishReasonName;
}

export function health(reply: HealthResponse): Health {
  return { ...reply, status: enumName(ServingStatus, reply.status, "SERVING_STATUS_") as ServingStatusName };
}

/** "FINISH_REASON_STOP" -> "stop", as the Python SDK names enum values; unknown values are "unrecognized". */
function enumName(values: Record<number, string>, value: number, prefix: string): string {
  return (values[value] ?? "UNRECOGNIZED").replace(prefix, "").toLowerCase();
}
