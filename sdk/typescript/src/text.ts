/**
 * Text of a streamed generation. TextAssembler (kiln/text.py, ported) decides which token ids to decode
 * next and which text is final; TextGeneration is what Session.generateText() returns: the text as it
 * becomes final, or, awaited, the whole reply.
 */

const REPLACEMENT = "\ufffd"; // what decoders show for an incomplete multi-byte character

/**
 * Text deltas of a generation whose tokens arrive in chunks. Someone else decodes (a local tokenizer or
 * the Detokenize RPC): this class says which ids to decode next (`toDecode`) and turns their text into
 * deltas (`decoded`). The deltas concatenate to the reply.
 *
 * Text is released once no later token can change it: never half of a multi-byte character (decoded as
 * U+FFFD until the rest arrives), never a tail that may be the start of a stop string. `finish` releases
 * the rest, cut before the stop string the server matched.
 *
 * Decoding cost stays bounded: once the decoded window grows past WINDOW tokens, it restarts CONTEXT
 * tokens before the end (one extra decode sets the new baseline), so each chunk costs O(WINDOW + chunk)
 * rather than O(length of the reply).
 */
export class TextAssembler {
  static readonly WINDOW = 64;
  static readonly CONTEXT = 8; // tokens of context kept when the window restarts (a character spans at most 4)

  private readonly stop: readonly string[];
  private readonly ids: number[] = [];
  private start = 0; // the window is ids[start:]
  private text = ""; // the latest decode of the window
  private released = 0; // UTF-16 units of `text` handed out
  private stale = false; // ids arrived since the last decode
  private restart: number | undefined; // a new window start whose baseline is still to be decoded

  constructor(stop: readonly string[] = []) {
    this.stop = [...stop];
  }

  add(tokenIds: readonly number[]): void {
    this.ids.push(...tokenIds);
    this.stale = tokenIds.length > 0 || this.stale;
  }

  /** The ids whose text `decoded` needs next, or null when the text is up to date. */
  toDecode(): number[] | null {
    if (this.stale) return this.ids.slice(this.start);
    return this.restart === undefined ? null : this.ids.slice(this.restart);
  }

  /** Takes the text of the ids `toDecode` returned; returns the text that became final. */
  decoded(text: string): string {
    if (this.stale) return this.windowDecoded(text);
    this.restarted(text);
    return "";
  }

  /**
   * The text not yet released, cut before `stopString` when the server says one matched. A trailing
   * U+FFFD now is a genuinely invalid byte sequence, so it is kept.
   */
  finish(stopString: string | null): string {
    const end = stopString ? this.text.indexOf(stopString, this.released) : -1;
    return this.release(end >= 0 ? end : this.text.length);
  }

  private windowDecoded(text: string): string {
    this.stale = false;
    this.text = text;
    const delta = this.release(this.safeEnd());
    if (this.ids.length - this.start > TextAssembler.WINDOW) {
      this.restart = this.ids.length - TextAssembler.CONTEXT;
    }
    return delta;
  }

  /**
   * `text` decodes the last CONTEXT ids alone. When the text still held back (a partial character, the
   * start of a stop string) lies within it, the window restarts there; otherwise it keeps growing until a
   * later restart fits.
   */
  private restarted(text: string): void {
    const held = this.text.slice(this.released);
    if (text.endsWith(held) && this.restart !== undefined) {
      this.start = this.restart;
      this.text = text;
      this.released = text.length - held.length;
    }
    this.restart = undefined;
  }

  private release(end: number): string {
    if (end <= this.released) return "";
    const delta = this.text.slice(this.released, end);
    this.released = end;
    return delta;
  }

  /**
   * End of the prefix of the window's text that no later token can change or cut. A trailing U+FFFD is
   * a character still to complete, so stop strings are matched against the text before it: "x" then
   * half of "é" may be the start of the stop string "xé".
   */
  private safeEnd(): number {
    let text = this.text;
    while (text.endsWith(REPLACEMENT)) text = text.slice(0, -REPLACEMENT.length);
    let end = text.length;
    for (const stop of this.stop) {
      const found = text.indexOf(stop, this.released);
      if (found >= 0) end = Math.min(end, found);
      end = Math.min(end, text.length - partialSuffix(text, stop));
    }
    return end;
  }
}

/** Length of the longest suffix of `text` that is a proper prefix of `stop`. */
function partialSuffix(text: string, stop: string): number {
  for (let length = Math.min(stop.length - 1, text.length); length > 0; length--) {
    if (text.endsWith(stop.slice(0, length))) return length;
  }
  return 0;
}

/**
 * The text of one generation: `for await (const piece of session.generateText(...))` streams it as it
 * becomes final (multi-byte characters whole, the reply cut before a matched stop string), and
 * `await session.generateText(...)` (or then/catch/finally) gives the whole reply. Use one or the other:
 * both read the same generation, which starts at the first read. Leaving the loop early cancels it.
 */
export class TextGeneration implements AsyncIterable<string>, Promise<string> {
  readonly [Symbol.toStringTag] = "TextGeneration";
  private whole: Promise<string> | undefined;

  /** @internal Session.generateText() makes these. */
  constructor(private readonly pieces: AsyncGenerator<string, void, undefined>) {}

  [Symbol.asyncIterator](): AsyncGenerator<string, void, undefined> {
    return this.pieces;
  }

  then<T = string, E = never>(
    onFulfilled?: ((text: string) => T | PromiseLike<T>) | null,
    onRejected?: ((reason: unknown) => E | PromiseLike<E>) | null,
  ): Promise<T | E> {
    return this.text().then(onFulfilled, onRejected);
  }

  catch<E = never>(onRejected?: ((reason: unknown) => E | PromiseLike<E>) | null): Promise<string | E> {
    return this.text().catch(onRejected);
  }

  finally(onFinally?: (() => void) | null): Promise<string> {
    return this.text().finally(onFinally);
  }

  private text(): Promise<string> {
    this.whole ??= joined(this.pieces);
    return this.whole;
  }
}

async function joined(pieces: AsyncIterable<string>): Promise<string> {
  let text = "";
  for await (const piece of pieces) text += piece;
  return text;
}
