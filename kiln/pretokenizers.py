"""llama.cpp's BPE pre-tokenizers, by the name a GGUF file gives in `tokenizer.ggml.pre`.

Transcribed from llama.cpp's src/llama-vocab.cpp at the commit llama-cpp-python 0.3.36 vendors (0c1e570): the
vocabulary loader's table of names (each selects a LLAMA_VOCAB_PRE_TYPE_* and sets options: ignore_merges,
add_bos, escape_whitespaces, no default BOS), and llm_tokenizer_bpe's regex list for each type, kept as
llama.cpp writes them (kiln/regex_split.py runs them as llama.cpp does). Types whose lists are equal share one
`Split`. llama.cpp refuses a name it does not know and warns, then uses `default`, when a file names none;
`pre_tokenizer` does the same.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kiln.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Split:
    """How one pre-tokenizer type cuts text into words: regexes applied in sequence, then (for byte-level
    vocabularies) each word spelled in GPT-2's byte alphabet. Gemma 4's type also takes a word of newlines
    whole when the vocabulary has it, and always adds BOS."""

    regexes: tuple[str, ...]
    byte_encode: bool = True
    newline_runs_whole: bool = False
    bos_forced: bool = False


@dataclass(frozen=True)
class PreTokenizer:
    """What a `tokenizer.ggml.pre` name selects. `ignore_merges`: a word found whole in the vocabulary is one
    token; `add_bos`: BOS is added unless the file says otherwise; `escape_whitespaces`: spaces are written
    as U+2581 before splitting; `bos_disabled`: no default BOS id (GLM)."""

    name: str
    split: Split
    ignore_merges: bool = False
    add_bos: bool = False
    escape_whitespaces: bool = False
    bos_disabled: bool = False


_LLAMA3 = Split((
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_JAIS2 = Split((
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
))
_DEEPSEEK_LLM = Split((
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
    r"\s+$",
    "[一-龥ࠀ-一가-\uD7FF]+",
    r"\p{N}+",
))
_DEEPSEEK_V3 = Split((
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
))
_SPARK2_5 = Split((
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+""",
    r"\p{N}",
))
_YOUTU = Split((
    "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_DEEPSEEK_CODER = Split((
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    "[一-龥ࠀ-一가-\uD7FF]+",
    r"\p{N}",
))
_FALCON = Split((
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
))
_STARCODER = Split((
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
))
_GPT2 = Split((
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
))
_QWEN2 = Split((
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_QWEN35 = Split((
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_BLOOM = Split((
    r" ?[^(\s|.,!?…。，、।۔،)]+",
))
_VIKING = Split((
    r" ?[^(\s|.,!?…。，、।۔،)]+",
    r"\p{N}",
))
_TEKKEN = Split((
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_CHAMELEON = Split((
    r"<sentinel:[0-9]+>",
    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    r"([\t\n]|    |  )",
    r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
))
_GPT4O = Split((
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_GRANITE_EMB_MULTI = Split((
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_TINY_AYA = Split((
    r"\d{1,3}(?=(?:\d{3})*\b)",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_KIMI_K2 = Split((
    r"\p{Han}+",
))
_SUPERBPE = Split((
    r"\p{N}+",
    r"(?=(\d{3})+(?!\d))",
))
_BAILINGMOE = Split((
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
))
_SEED_CODER = Split((
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_UFAKZEKA = Split((
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_AFMOE = Split((
    r"\p{AFMoE_digits}",
    "[一-鿿㐀-䶿豈-\ufaff\u3040-ゟ゠-ヿ･-ﾟ⼀-\u2fdfเ-\u0e7f\u0e80-\u0effក-\u17ffက-႟ꩠ-ꩿꧠ-\ua9ff가-\uD7AFᄀ-ᇿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
))
_LAGUNA = Split((
    r"[^\n]+|[\n]+",
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_EXAONE_MOE = Split((
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
))
_GEMMA4 = Split((
    r"[^\n]+|[\n]+",
), byte_encode=False, newline_runs_whole=True, bos_forced=True)
_SARVAM_MOE = Split((
    r"[^\n]+|[\n]+",
), byte_encode=False)
_MINICPM5 = Split((
    r"\p{N}{1,3}",
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
))
_WHITESPACE = Split((
    r"\S+",
), byte_encode=False)
_DEFAULT = Split((
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
))


def _named(split: Split, names: list[str], **options: bool) -> list[PreTokenizer]:
    return [PreTokenizer(name, split, **options) for name in names]


PRE_TOKENIZERS: dict[str, PreTokenizer] = {pre.name: pre for pre in (
    *_named(_DEFAULT, ["default"]),
    *_named(_MINICPM5, ["minicpm5"], ignore_merges=True),
    *_named(_LLAMA3, ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                      "jina-v5-nano"], ignore_merges=True, add_bos=True),
    *_named(_DEEPSEEK_LLM, ["deepseek-llm"]),
    *_named(_DEEPSEEK_CODER, ["deepseek-coder"]),
    *_named(_DEEPSEEK_V3, ["deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"]),
    *_named(_SPARK2_5, ["spark2_5"]),
    *_named(_YOUTU, ["youtu"], ignore_merges=True),
    *_named(_FALCON, ["falcon"]),
    *_named(_GPT2, ["mpt", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                    "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "olmo", "jais", "exaone4",
                    "trillion", "granite-docling"]),
    *_named(_STARCODER, ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
                         "mellum2"]),
    *_named(_JAIS2, ["jais-2"]),
    *_named(_GEMMA4, ["gemma4", "granite-embed-multi-311m"], escape_whitespaces=True),
    *_named(_SARVAM_MOE, ["sarvam-moe"], escape_whitespaces=True),
    *_named(_WHITESPACE, ["whitespace"]),
    *_named(_QWEN2, ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan", "grok-2",
                     "solar-open"]),
    *_named(_QWEN35, ["qwen35"]),
    *_named(_LLAMA3, ["dbrx", "smaug-bpe"]),
    *_named(_BLOOM, ["poro-chat", "bloom", "gpt3-finnish"]),
    *_named(_LLAMA3, ["chatglm-bpe"], bos_disabled=True),
    *_named(_LLAMA3, ["glm4", "glm5"], ignore_merges=True, bos_disabled=True),
    *_named(_VIKING, ["viking"]),
    *_named(_TEKKEN, ["tekken"], ignore_merges=True, add_bos=True),
    *_named(_EXAONE_MOE, ["exaone-moe"]),
    *_named(_CHAMELEON, ["chameleon"], add_bos=True),
    *_named(_GPT4O, ["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"]),
    *_named(_GRANITE_EMB_MULTI, ["granite-embed-multi-97m"], ignore_merges=True),
    *_named(_TINY_AYA, ["tiny_aya", "cohere2moe"]),
    *_named(_SUPERBPE, ["superbpe"]),
    *_named(_BAILINGMOE, ["bailingmoe", "bailingmoe2", "llada-moe"]),
    *_named(_SEED_CODER, ["seed-coder"]),
    *_named(_KIMI_K2, ["kimi-k2"]),
    *_named(_UFAKZEKA, ["ufakzeka"]),
    *_named(_AFMOE, ["afmoe"]),
    *_named(_LAGUNA, ["laguna"]),
)}
DEFAULT = PRE_TOKENIZERS["default"]


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The pre-tokenizer `name` selects; `default` (with a warning, as llama.cpp) for a file that names none."""
    if not name:
        logger.warning("the GGUF file names no pre-tokenizer (tokenizer.ggml.pre): using 'default', as llama.cpp does; "
                       "token ids may differ from the model's own tokenizer")
        return DEFAULT
    if name not in PRE_TOKENIZERS:
        raise InvalidArgumentError(
            f"unknown GGUF pre-tokenizer {name!r} (llama.cpp refuses it too); known: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[name]
