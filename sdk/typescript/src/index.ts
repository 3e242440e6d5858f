/**
 * @kiln/client: the TypeScript SDK of Kiln, a session-native LLM inference runtime. The same contract as
 * the Python SDK (kiln.client), over the same gRPC service (proto/kiln/v1/runtime.proto).
 */
export { Client, type ClientOptions, type CreateSessionOptions, type GenerateOptions, Session } from "./client.js";
export {
  CancelledError,
  DeadlineExceededError,
  FailedPreconditionError,
  InvalidArgumentError,
  KilnError,
  NotFoundError,
  PermissionDeniedError,
  ResourceExhaustedError,
  UnauthenticatedError,
  UnavailableError,
} from "./errors.js";
export type { SessionInfo, SnapshotInfo, Usage } from "./gen/kiln/v1/runtime.js";
export { Generation, type GenerationResult } from "./generation.js";
export { TextAssembler, TextGeneration } from "./text.js";
export type { Pem, TlsOptions } from "./tls.js";
export type { Tokenizer, TokenizerOption } from "./tokenizer.js";
export type { CallOptions } from "./transport.js";
export type { FinishReasonName, Health, SamplingOptions, ServingStatusName, TokenIds } from "./wire.js";
