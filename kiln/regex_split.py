"""Text into words before BPE, exactly as llama.cpp splits it (`unicode_regex_split`, src/unicode.cpp).

A pre-tokenizer is a list of regexes applied in sequence: each one splits every piece the previous ones left
into its matches and the text between them. llama.cpp runs them in C++ std::regex (ECMAScript), which knows
no Unicode categories, so it first *collapses* the text: every non-ASCII codepoint becomes one byte naming its
category (letter, number, punctuation, mark, symbol, other; whitespace becomes \\v) and each `\\p{..}` class of
the regex becomes the set of those bytes plus the class's ASCII members. Every non-ASCII letter is then both
"upper" and "lower" case to a regex such as GPT-4o's, and that is what llama.cpp's token ids follow. Python's
`re` backtracks as ECMAScript does, so the same collapsed regexes over the same collapsed text give the same
pieces. llama.cpp's hand-written splitters for GPT-2, Llama 3 and Qwen 2 regexes are those regexes; Kimi K2's
(Han runs apart from other letters) and AFMoE's digit grouping are written out here.

Categories are this Python's `unicodedata`, completed with the codepoints llama.cpp's tables (Unicode 15.1)
assign that an older Python leaves unassigned.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from functools import cache

# The byte llama.cpp collapses each category to, and the ASCII members its `\p{..}` class keeps.
_NUMBER, _LETTER, _PUNCTUATION, _MARK, _SYMBOL, _OTHER, _WHITESPACE = (
    "\xd1", "\xd2", "\xd3", "\xd4", "\xd5", "\xd0", "\x0b")
_HAN = "\xd6"  # Kimi K2's splitter tells Han apart from other letters; llama.cpp's regexes never see this byte
_CLASSES = {
    r"\p{N}": _NUMBER + "0-9",
    r"\p{L}": _LETTER + "A-Za-z",
    r"\p{P}": _PUNCTUATION + r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    r"\p{M}": _MARK,
    r"\p{S}": _SYMBOL + r"\$\+<->^`\|\~",
    r"\p{Lu}": _LETTER + "A-Za-z",
    r"\p{Ll}": _LETTER + "A-Za-z",
    r"\p{Lt}": _LETTER + "A-Za-z",
    r"\p{Lm}": _LETTER + "A-Za-z",
    r"\p{Lo}": _LETTER + "A-Za-z",
}
_BY_CATEGORY = {"N": _NUMBER, "L": _LETTER, "P": _PUNCTUATION, "M": _MARK, "S": _SYMBOL}
# llama.cpp's whitespace (unicode-data.cpp unicode_set_whitespace) beyond ASCII.
_NON_ASCII_WHITESPACE = frozenset(
    map(chr, (0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000)))
# Codepoints Unicode 15.1 assigns that Unicode 14 (Python 3.11) does not: "first-last" hex and category.
_UNICODE_15_1 = (
    "CF3M ECEM 2FFC-2FFFS 31EFS 10EFD-10EFFM 1123F-11240L 11241M 11B00-11B09P 11F00-11F01M 11F02L 11F03M "
    "11F04-11F10L 11F12-11F33L 11F34-11F3AM 11F3E-11F42M 11F43-11F4FP 11F50-11F59N 1342FL 13440M 13441-13446L "
    "13447-13455M 1B132L 1B155L 1D2C0-1D2D3N 1DF25-1DF2AL 1E030-1E06DL 1E08FM 1E4D0-1E4EBL 1E4EC-1E4EFM "
    "1E4F0-1E4F9N 1F6DCS 1F774-1F776S 1F77B-1F77FS 1F7D9S 1FA75-1FA77S 1FA87-1FA88S 1FAAD-1FAAFS 1FABB-1FABDS "
    "1FABFS 1FACE-1FACFS 1FADA-1FADBS 1FAE8S 1FAF7-1FAF8S 2B739L 2EBF0-2EE5DL 31350-323AFL"
)
# llama.cpp's unicode_cpt_is_han.
_HAN_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
               (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _newer_unicode() -> dict[int, str]:
    table = {}
    for entry in _UNICODE_15_1.split():
        first, _, last = entry[:-1].partition("-")
        for codepoint in range(int(first, 16), int(last or first, 16) + 1):
            table[codepoint] = _BY_CATEGORY[entry[-1]]
    return table


_NEWER = _newer_unicode()


def _category(char: str) -> str:
    """The byte llama.cpp collapses a non-ASCII `char` to."""
    if char in _NON_ASCII_WHITESPACE:
        return _WHITESPACE
    category = unicodedata.category(char)
    if category == "Cn":
        return _NEWER.get(ord(char), _OTHER)
    return _BY_CATEGORY.get(category[0], _OTHER)


def _is_han(char: str) -> bool:
    codepoint = ord(char)
    return any(first <= codepoint <= last for first, last in _HAN_RANGES)


class _Translations(dict):
    """str.translate tables that compute each character's byte the first time they meet it."""

    def __init__(self, collapse: Callable[[str], str]) -> None:
        super().__init__()
        self._collapse = collapse

    def __missing__(self, codepoint: int) -> str:
        char = chr(codepoint)
        value = char if codepoint < 128 else self._collapse(char)
        self[codepoint] = value
        return value


def _kimi_category(char: str) -> str:
    return _HAN if _is_han(char) else _category(char)


def _wide(char: str) -> str:
    return _WHITESPACE if char in _NON_ASCII_WHITESPACE else char


_COLLAPSED = _Translations(_category)
_KIMI = _Translations(_kimi_category)
_WIDE = _Translations(_wide)  # llama.cpp's std::wregex path: only non-ASCII whitespace is replaced

# Kimi K2 (llama.cpp's unicode_regex_split_custom_kimi_k2) over text collapsed with Han apart.
_KIMI_K2 = re.compile(
    f"{_HAN}+"
    f"|[^\\r\\n{_LETTER}{_HAN}A-Za-z{_NUMBER}0-9]?[{_LETTER}A-Za-z]+(?:'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?"
    f"|[{_NUMBER}0-9]{{1,3}}| ?[^\\s{_LETTER}{_HAN}A-Za-z{_NUMBER}0-9]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    re.ASCII,
)
_DIGIT_RUN = re.compile(f"[{_NUMBER}0-9]+")


def split(text: str, regexes: Sequence[str]) -> list[str]:
    """`text` cut into the words llama.cpp's `unicode_regex_split(text, regexes)` gives (before byte encoding),
    empty pieces left out."""
    views: dict[int, str] = {}  # the text as each table translates it, made when first needed

    def view(table: _Translations) -> str:
        return views.get(id(table)) or views.setdefault(id(table), text.translate(table))

    lengths = [len(text)]
    for regex in regexes:
        if regex == r"\p{Han}+":
            lengths = _split_by(_KIMI_K2, view(_KIMI), lengths)
        elif regex in (r"\p{AFMoE_digits}", r"\d{1,3}(?=(?:\d{3})*\b)"):
            lengths = _digit_groups(view(_COLLAPSED), lengths)
        else:
            collapsed = any(name in regex for name in _CLASSES)
            lengths = _split_by(_compiled(regex), view(_COLLAPSED if collapsed else _WIDE), lengths)
    words, start = [], 0
    for length in lengths:
        if length:
            words.append(text[start : start + length])
        start += length
    return words


def _split_by(pattern: re.Pattern[str], text: str, lengths: list[int]) -> list[int]:
    """unicode_regex_split_stl: each piece into its matches and the text between them."""
    out, start = [], 0
    for length in lengths:
        done = 0
        for match in pattern.finditer(text[start : start + length]):
            if match.start() > done:
                out.append(match.start() - done)
            out.append(match.end() - match.start())
            done = match.end()
        if done < length:
            out.append(length - done)
        start += length
    return out


def _digit_groups(collapsed: str, lengths: list[int]) -> list[int]:
    """unicode_regex_split_custom_afmoe: each run of digits as a group of its length modulo 3, then groups
    of 3; the text before a run joins the run's first group."""
    out, start = [], 0
    for length in lengths:
        end, previous = start + length, start
        for run in _DIGIT_RUN.finditer(collapsed, start, end):
            first = run.start() + (run.end() - run.start()) % 3
            leading = [first] if first > run.start() else []
            for cut in leading + list(range(first + 3, run.end() + 1, 3)):
                out.append(cut - previous)
                previous = cut
        if previous < end:
            out.append(end - previous)
        start = end
    return out


@cache
def _compiled(regex: str) -> re.Pattern[str]:
    """llama.cpp's regex as Python runs it: categories collapsed as llama.cpp collapses them, and ECMAScript's
    `$` (the end of the input only) as `\\Z`."""
    if any(name in regex for name in _CLASSES):
        regex = _collapse_classes(regex)
    return re.compile(_end_anchors(regex), re.ASCII)


def _collapse_classes(regex: str) -> str:
    """llama.cpp's collapse of a regex, quirks included (it tracks `[...]` by the previous character only)."""
    out, inside, i = [], False, 0
    while i < len(regex):
        char = regex[i]
        if char == "[" and (i == 0 or regex[i - 1] != "\\"):
            out.append(char)
            inside = True
        elif inside and char == "]" and regex[i - 1] != "\\":
            out.append(char)
            inside = False
        elif regex.startswith("\\p{", i) and i + 3 < len(regex):
            close = regex.find("}", i + 3)
            members = _CLASSES.get(regex[i : close + 1]) if close != -1 and close <= i + 10 else None
            if members is not None:
                out.append(members if inside else f"[{members}]")
                i = close + 1
                continue
            out.append(char)
        else:
            out.append(char)
        i += 1
    return "".join(out)


def _end_anchors(regex: str) -> str:
    """Unescaped `$` outside brackets as `\\Z`: Python's `$` also matches before a final newline."""
    out, inside, escaped = [], False, False
    for char in regex:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "[":
            inside = True
        elif char == "]":
            inside = False
        elif char == "$" and not inside:
            out.append(r"\Z")
            continue
        out.append(char)
    return "".join(out)
