/**
 * TextAssembler (ported from kiln/text.py, tests from tests/test_text.py): text deltas of streamed token
 * chunks are whole characters, never show part of a stop string, and cost bounded decoding windows.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { TextAssembler } from "@kiln/client";

import { byteTokenizer } from "./helpers.js";

const TOKENIZER = byteTokenizer(); // one id per UTF-8 byte: multi-byte characters always span several ids
const TEXT = "Grüße aus Köln ✓ 日本語 🎉 ".repeat(12); // far longer than one decode window

const idsOf = (text: string): number[] => [...(TOKENIZER.encode(text, false) as number[])];
const decode = (ids: number[]): string => TOKENIZER.decode(ids, true) as string;

/** The non-empty pieces, and the lengths of the id windows decoded, for ids arriving `chunk` at a time. */
function stream(ids: number[], chunk: number, stop: string[] = [], stopString: string | null = null) {
  const assembler = new TextAssembler(stop);
  const pieces: string[] = [];
  const windows: number[] = [];
  for (let start = 0; start < ids.length; start += chunk) {
    assembler.add(ids.slice(start, start + chunk));
    for (let window = assembler.toDecode(); window !== null; window = assembler.toDecode()) {
      windows.push(window.length);
      pieces.push(assembler.decoded(decode(window)));
    }
  }
  pieces.push(assembler.finish(stopString));
  return { pieces: pieces.filter((piece) => piece !== ""), windows };
}

describe("TextAssembler", () => {
  for (const chunk of [1, 3, 50]) {
    it(`pieces are whole characters and add up to the text (chunks of ${chunk})`, () => {
      const { pieces, windows } = stream(idsOf(TEXT), chunk);
      assert.equal(pieces.join(""), TEXT);
      assert.ok(pieces.every((piece) => !piece.includes("\ufffd")));
      assert.ok(Math.max(...windows) <= TextAssembler.WINDOW + chunk, "decoding cost does not grow with the text");
    });
  }

  it("text is cut before the matched stop string, and its start is held back", () => {
    const ids = idsOf("Hello, world STOP and more").slice(0, "Hello, world STOP".length); // the engine stops there
    const { pieces } = stream(ids, 1, ["STOP"], "STOP");
    assert.equal(pieces.join(""), "Hello, world ");
    assert.ok(pieces.slice(0, -1).every((piece) => !/(S|ST|STO)$/.test(piece)));
  });

  it("a held-back prefix of a stop string is released when it does not complete", () => {
    assert.equal(stream(idsOf("a ST b"), 1, ["STOP"]).pieces.join(""), "a ST b");
  });

  it("an invalid byte at the end is kept", () => {
    const ids = [...idsOf("ab"), ...idsOf("é").slice(0, 1)]; // the first byte of a two-byte character only
    assert.equal(stream(ids, 1).pieces.join(""), "ab\ufffd");
  });

  for (const stop of ["xé", "z✓", "日本", "z🎉"]) {
    for (const chunk of [1, 2, 3, 4]) {
      it(`the start of the stop string ${stop} is held back while its last character is half-decoded (chunks of ${chunk})`, () => {
        const prefix = `${"Grüße aus Köln ".repeat(8)}a`;
        const ids = idsOf(`${prefix}${stop} and more`).slice(0, Buffer.byteLength(prefix + stop));
        const { pieces, windows } = stream(ids, chunk, [stop], stop);
        assert.equal(pieces.join(""), prefix);
        assert.ok(Math.max(...windows) <= TextAssembler.WINDOW + chunk);
      });
    }
  }
});
