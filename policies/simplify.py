"""Query simplification: progressively simpler variants of a search query that found nothing.

Rules (each applied on top of the previous; the original itself is never returned):

Spaced queries (English and other spaced scripts, including English with a few CJK words):
1. drop quotes and special characters: keep letters, digits and marks of any script, spaces,
   hyphens and apostrophes inside words, dots inside numbers ("3.11") and a trailing run of
   ``+``/``#`` on a word ("C++", "C#");
2. drop year qualifiers: 1900-2099 and ranges like "2019-2021", with a connecting word
   before a year ("in 2023", "from 2019 to 2021");
3. drop filler words (a short English stopword list; ALL-CAPS acronyms such as "WHO" are kept
   unless the whole query is in capitals);
4. keep the first five words;  5. keep the first three words.

Unspaced queries (Chinese, Japanese, Thai...: letters mostly from such scripts, or no
whitespace at all and some such letters):
1. drop quotes and brackets, turn other special punctuation into spaces;
2. drop year qualifiers ("2024", "2024年", "2019-2021");
3. split into segments on ，。、；：？！,.;:?! and spaces, and drop trailing segments one at a time;
4. if a single segment longer than 8 characters is left, its first 8, then its first 4
   characters (a Latin word or number at the cut is kept whole).

A step that changes nothing, or would leave nothing, adds no variant; variants equal to the
original or to an earlier variant (ignoring case, spacing and final ?!.) are skipped, and at
most `max_variants` are returned. No variant is ever empty.
"""

from __future__ import annotations

import re
import unicodedata

FILLER_WORDS: frozenset[str] = frozenset(
    """
    a an the of for in on at to from by with about into and or
    how what what's which who whom whose why when where is are was were be been do does did
    can could would should will shall i me my we our you your this that these those there
    best latest please find search show tell give get list some any
    """.split()
)
_YEAR_CONNECTORS = frozenset(
    "in of for since from during until till to through and or between before after".split()
)
_YEAR = re.compile(r"(?:19|20)\d{2}(?:-(?:19|20)\d{2})?")
_CJK_YEAR = re.compile(
    r"(?<!\d)(?:19|20)\d{2}(?:\s*[-–~～至到]\s*(?:19|20)\d{2})?\s*(?:年度|年)?(?!\d)"
)
_QUOTES_BRACKETS = frozenset("\"'“”‘’「」『』【】〔〕〈〉《》（）()[]{}<>＜＞［］｛｝〖〗«»‹›„‚`")
_SEPARATORS = "，。、；：？！,.;:?!．｡､"
# A dot between digits is part of a number ("3.11"), not a separator.
_SEPARATOR_RUN = re.compile(
    rf"(?:[{re.escape(_SEPARATORS.replace('.', ''))}\s]|(?<!\d)\.|\.(?!\d))+"
)
_WORD_JOINERS = frozenset("-'’")
# Scripts written without spaces between words.
_UNSPACED_RANGES = (
    (0x0E00, 0x0EFF),  # Thai, Lao
    (0x1000, 0x109F),  # Myanmar
    (0x1780, 0x17FF),  # Khmer
    (0x3005, 0x3007),  # 々 〆 〇
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x31F0, 0x31FF),  # Katakana extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF66, 0xFF9F),  # half-width Katakana
    (0x20000, 0x3FFFF),  # CJK extensions B and later
)
_TRUNCATIONS = (8, 4)
_LATIN_WORD = re.compile(r"[A-Za-z0-9]+(?:[.'-][A-Za-z0-9]+)*[+#]*")


def _is_word_char(char: str) -> bool:
    return unicodedata.category(char)[0] in "LNM"


def _is_unspaced_letter(char: str) -> bool:
    code = ord(char)
    return any(lo <= code <= hi for lo, hi in _UNSPACED_RANGES)


def _is_unspaced_query(query: str) -> bool:
    letters = [c for c in query if c.isalpha()]
    unspaced = sum(1 for c in letters if _is_unspaced_letter(c))
    if not unspaced:
        return False
    return not any(c.isspace() for c in query.strip()) or unspaced * 2 >= len(letters)


def _key(text: str) -> str:
    """What makes two queries the same search: case, spacing and final punctuation do not."""
    return " ".join(text.casefold().split()).rstrip("?!.。？！ ")


def _keep_inside_word(text: str, i: int) -> bool:
    char = text[i]
    before = text[i - 1] if i > 0 else ""
    after = text[i + 1] if i + 1 < len(text) else ""
    if char in _WORD_JOINERS:
        return bool(before and after) and _is_word_char(before) and _is_word_char(after)
    if char == ".":
        return before.isdigit() and after.isdigit()
    if char in "+#":
        # "C++", "C#": a run of +/# right after a word and ending it.
        j = i
        while j > 0 and text[j - 1] in "+#":
            j -= 1
        end = i
        while end + 1 < len(text) and text[end + 1] in "+#":
            end += 1
        rest = text[end + 1 : end + 2]
        return j > 0 and _is_word_char(text[j - 1]) and (not rest or rest.isspace())
    return False


def _strip_special(query: str) -> str:
    chars = [
        c if _is_word_char(c) or c.isspace() or _keep_inside_word(query, i) else " "
        for i, c in enumerate(query)
    ]
    return " ".join("".join(chars).split())


def _drop_years(words: list[str]) -> list[str]:
    is_year = [bool(_YEAR.fullmatch(w)) for w in words]
    kept = []
    for i, word in enumerate(words):
        if is_year[i]:
            continue
        if word.lower() in _YEAR_CONNECTORS and i + 1 < len(words) and is_year[i + 1]:
            continue
        kept.append(word)
    return kept


def _drop_fillers(words: list[str], all_caps: bool) -> list[str]:
    def is_filler(word: str) -> bool:
        if not all_caps and len(word) > 1 and word.isupper():
            return False  # an acronym: WHO, IT, US
        return word.lower().replace("’", "'") in FILLER_WORDS

    return [w for w in words if not is_filler(w)]


def _spaced_variants(query: str) -> list[str]:
    cleaned = _strip_special(query)
    words = cleaned.split()
    all_caps = cleaned.isupper()
    steps: list[list[str]] = []
    for rule in (
        lambda w: w,
        _drop_years,
        lambda w: _drop_fillers(w, all_caps),
        lambda w: w[:5],
        lambda w: w[:3],
    ):
        words = rule(words) or words  # a rule that would leave nothing is skipped
        steps.append(words)
    return [" ".join(w) for w in steps if w]


def _tidy_unspaced(text: str) -> str:
    # Collapse separator runs to their first character and trim them off both ends.
    text = _SEPARATOR_RUN.sub(lambda m: m.group(0).strip()[:1] or " ", text)
    return text.strip(_SEPARATORS + " ")


def _truncate(segment: str, limit: int) -> str:
    if len(segment) <= limit:
        return segment
    cut = limit
    while cut < len(segment) and unicodedata.category(segment[cut])[0] == "M":
        cut += 1  # keep combining marks with their base letter
    # Never cut a Latin word or a number in two: finish it ("如何在Python", not "如何在Pyth").
    for word in _LATIN_WORD.finditer(segment):
        if word.start() < cut < word.end():
            cut = word.end()
    return segment[:cut]


def _unspaced_variants(query: str) -> list[str]:
    chars = []
    for i, c in enumerate(query):
        if c in _QUOTES_BRACKETS:
            continue
        if _is_word_char(c) or c.isspace() or c in _SEPARATORS or c == "・":
            chars.append(c)
        else:
            chars.append(c if _keep_inside_word(query, i) else " ")
    cleaned = _tidy_unspaced("".join(chars))
    without_years = _tidy_unspaced(_CJK_YEAR.sub(" ", cleaned)) or cleaned
    variants = [cleaned, without_years]
    # Each segment ends where a separator run starts; prefixes keep the original separators.
    ends = [m.start() for m in _SEPARATOR_RUN.finditer(without_years)]
    for end in reversed(ends):
        variants.append(without_years[:end])
    first = without_years[: ends[0]] if ends else without_years
    if len(first) > _TRUNCATIONS[0]:  # only a long segment is worth cutting
        variants.extend(_truncate(first, limit) for limit in _TRUNCATIONS)
    return [v for v in variants if v]


def simplify_query(query: str, max_variants: int) -> list[str]:
    """Simpler variants of `query`, best first (see the module docstring for the rules)."""
    if max_variants <= 0:
        return []
    candidates = _unspaced_variants(query) if _is_unspaced_query(query) else _spaced_variants(query)
    seen = {_key(query)}
    out: list[str] = []
    for candidate in candidates:
        key = _key(candidate)
        if not key or key in seen:
            continue
        seen.add(key)
        out.append(candidate)
        if len(out) >= max_variants:
            break
    return out
