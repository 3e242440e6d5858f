/**
 * The SDK's opt-in tokenizer (the Python SDK's client/text.py). The runtime works on token ids; a client
 * turns text into ids only if its user opted in when creating it: `tokenizer: "server"` (the Tokenize
 * and Detokenize RPCs) or a local tokenizer.
 */
import { FailedPreconditionError, InvalidArgumentError } from "./errors.js";
import { shown, type TokenIds } from "./wire.js";

/** A tokenizer in this process; either method may return a promise. */
export interface Tokenizer {
  /** `addSpecialTokens`: add BOS and the like (the SDK asks for them only at the very start of a history). */
  encode(text: string, addSpecialTokens: boolean): TokenIds | Promise<TokenIds>;
  decode(tokenIds: number[], skipSpecialTokens: boolean): string | Promise<string>;
}

/** "server" for the server's tokenizer, or a local one. */
export type TokenizerOption = "server" | Tokenizer;

export const SERVER = "server";

/** Checks the client's `tokenizer` option: undefined (token ids only), "server", or a local tokenizer. */
export function optIn(tokenizer: unknown): TokenizerOption | undefined {
  if (tokenizer === undefined || tokenizer === SERVER) return tokenizer;
  const methods = typeof tokenizer === "object" && tokenizer !== null ? (tokenizer as Partial<Tokenizer>) : {};
  if (typeof methods.encode !== "function" || typeof methods.decode !== "function") {
    throw new InvalidArgumentError(
      `tokenizer must be undefined, "server" or an object with encode() and decode(), got ${shown(tokenizer)}`,
    );
  }
  return tokenizer as Tokenizer;
}

/** The opted-in tokenizer, or FailedPreconditionError explaining the opt-in to `what`. */
export function requireTokenizer(tokenizer: TokenizerOption | undefined, what: string): TokenizerOption {
  if (tokenizer === undefined) {
    throw new FailedPreconditionError(
      `${what} needs a tokenizer: create the client with { tokenizer: "server" } (the server's tokenizer) ` +
        "or { tokenizer: <a local tokenizer with encode() and decode()> }, or work with token ids",
    );
  }
  return tokenizer;
}
