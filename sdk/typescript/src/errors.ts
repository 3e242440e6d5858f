/**
 * Typed errors, one class per gRPC status, with the names of the Python SDK's (kiln.errors). The SDK
 * picks the class by the status code, never by parsing messages; checks made before a call (bad token
 * ids, a closed client) throw the same classes with the Python SDK's messages.
 */
import { status } from "@grpc/grpc-js";

/** Every error the SDK throws. `code` names the gRPC status ("NOT_FOUND", "INTERNAL", ...). */
export class KilnError extends Error {
  /** The status this class stands for; KilnError itself is used for statuses without a class. */
  static readonly code: string = "UNKNOWN";
  readonly code: string;

  constructor(message: string, options?: { code?: string; cause?: unknown }) {
    super(message, options?.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.code = options?.code ?? (new.target as typeof KilnError).code;
  }
}

/** Bad token ids (not integers, outside the vocabulary), bad or absurd parameters, an empty append. */
export class InvalidArgumentError extends KilnError {
  static override readonly code = "INVALID_ARGUMENT";
}

/** Unknown, closed or evicted session (or one that belongs to another API key). */
export class NotFoundError extends KilnError {
  static override readonly code = "NOT_FOUND";
}

/** The call is valid but its target cannot take it now: an append while a generate runs, a closed client. */
export class FailedPreconditionError extends KilnError {
  static override readonly code = "FAILED_PRECONDITION";
}

/** KV capacity or the session limit, even after evicting idle sessions; a message over the size limit. */
export class ResourceExhaustedError extends KilnError {
  static override readonly code = "RESOURCE_EXHAUSTED";
}

/** No API key, a malformed one, or one the server does not know. */
export class UnauthenticatedError extends KilnError {
  static override readonly code = "UNAUTHENTICATED";
}

export class PermissionDeniedError extends KilnError {
  static override readonly code = "PERMISSION_DENIED";
}

/** The call was cancelled: by its AbortSignal here, or on the server's side. */
export class CancelledError extends KilnError {
  static override readonly code = "CANCELLED";
}

/** The server cannot take the call now (unreachable, or shutting down); retrying later may work. */
export class UnavailableError extends KilnError {
  static override readonly code = "UNAVAILABLE";
}

/** The call's deadline (`timeoutMs`) passed before it finished. */
export class DeadlineExceededError extends KilnError {
  static override readonly code = "DEADLINE_EXCEEDED";
}

const TYPED_ERRORS = [
  InvalidArgumentError,
  NotFoundError,
  FailedPreconditionError,
  ResourceExhaustedError,
  UnauthenticatedError,
  PermissionDeniedError,
  CancelledError,
  UnavailableError,
  DeadlineExceededError,
];
const BY_CODE = new Map<string, typeof KilnError>(TYPED_ERRORS.map((error) => [error.code, error]));

/**
 * The typed error of a failed call. Statuses without a class of their own (INTERNAL, UNKNOWN, ...)
 * give a KilnError whose `code` names the status, as in the Python SDK.
 */
export function errorFor(code: number, details: string | undefined): KilnError {
  const name = status[code] ?? "UNKNOWN";
  const Typed = BY_CODE.get(name);
  if (Typed !== undefined) return new Typed(details || name);
  return new KilnError(details ? `${name}: ${details}` : name, { code: name });
}

/** What calls on a closed client throw, and what reading a stream the close ended throws. */
export function clientClosed(): FailedPreconditionError {
  return new FailedPreconditionError("the client is closed");
}
