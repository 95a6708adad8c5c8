"""Query simplification: progressively simpler variants of a search query that found nothing.

Each variant costs a vendor call, so all the cleaning happens in the first variant and every
later one is shorter (the original itself is never returned).

Spaced queries (English and other spaced scripts, including English with a few CJK words):
1. the cleaned query, with all of:
   - quotes and special characters dropped: keep letters, digits and marks of any script,
     spaces, hyphens and apostrophes inside words, underscores attached to a word
     ("unique_ptr", "__init__"), dots inside numbers ("3.11") and a trailing run of
     ``+``/``#`` on a word ("C++", "C#");
   - year qualifiers dropped: 1900-2099 and ranges like "2019-2021", with a connecting word
     before a year ("in 2023", "from 2019 to 2021");
   - filler words dropped (a short English stopword list; ALL-CAPS acronyms such as "WHO" are
     kept unless the whole query is in capitals; request verbs such as "find", "show" and
     "list" only in the query's leading run of filler words: "linux find files" keeps "find");
2. its first three key terms;  3. its first two key terms. Key terms are the cleaned
   query's words less linking words ("vs", "between", "near"...); a shortened variant never
   ends on a negation or an ordinal ("not", "2nd"), which lean on the word after them. So an
   empty answer reaches three words by the second variant.

Unspaced queries (Chinese, Japanese, Thai...: letters mostly from such scripts, or no
whitespace at all and some such letters):
1. the cleaned query: quotes and brackets dropped, other special punctuation turned into
   spaces, year qualifiers dropped ("2024", "2024年", "2019-2021");
2. split into segments on ，。、；：？！,.;:?! and spaces, and drop trailing segments one at a time;
3. if a single segment longer than 8 characters is left, its first 8, then its first 4
   characters (a Latin word or number at the cut is kept whole).

A cleaning step that would leave nothing is skipped; variants equal to the original or to an
earlier variant (ignoring case, spacing and final ?!.) are skipped, and at most `max_variants`
are returned. No variant is ever empty.
"""

from __future__ import annotations

import re
import unicodedata

FILLER_WORDS: frozenset[str] = frozenset(
    """
    a an the of for in on at to from by with about into and or
    how what what's which who whom whose why when where is are was were be been do does did
    can could would should will shall i me my we our you your this that these those there
    best latest please some any
    """.split()
)
# Filler only before the first content word ("find me the best...", "can you show me..."):
# later they are terms ("linux find files", "python list comprehension", "git show").
_REQUEST_VERBS = frozenset("find search show tell give get list".split())
# Not key terms: left out of the shorter variants ("postgres vs mysql replication" -> "postgres
# mysql replication"). Prepositions and conjunctions that are filler words are already gone.
_LINKING_WORDS = frozenset(
    """
    vs versus than like per via near between against within across using including except among
    toward towards after before during since until
    """.split()
)
# Key terms that need the next word: a shorter variant never ends on one ("python not").
_NEGATIONS = frozenset("not no without never".split())
_ORDINAL = re.compile(r"\d+(?:st|nd|rd|th)", re.IGNORECASE)
_WORD_CUTS = (3, 2)
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
_LATIN_WORD = re.compile(r"[A-Za-z0-9_]+(?:[.'-][A-Za-z0-9_]+)*[+#]*")


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
    if char == "_":
        # Identifiers: "unique_ptr", "__init__"; a lone "_" between spaces is not a word.
        start, end = i, i
        while start > 0 and text[start - 1] == "_":
            start -= 1
        while end + 1 < len(text) and text[end + 1] == "_":
            end += 1
        edges = text[start - 1 : start] + text[end + 1 : end + 2]
        return any(_is_word_char(c) for c in edges)
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


def _is_acronym(word: str, all_caps: bool) -> bool:
    """WHO, IT, US: kept whatever the word lists say, unless the whole query is in capitals."""
    return not all_caps and len(word) > 1 and word.isupper()


def _drop_fillers(words: list[str], all_caps: bool) -> list[str]:
    kept: list[str] = []
    for word in words:
        lowered = word.lower().replace("’", "'")
        filler = lowered in FILLER_WORDS or (not kept and lowered in _REQUEST_VERBS)
        if _is_acronym(word, all_caps) or not filler:
            kept.append(word)
    return kept


def _cut(words: list[str], limit: int, all_caps: bool) -> list[str]:
    """The first `limit` key terms of `words`, or `words` when it is no longer than that."""
    if len(words) <= limit:
        return words
    terms = [w for w in words if _is_acronym(w, all_caps) or w.lower() not in _LINKING_WORDS]
    kept = (terms or words)[:limit]
    while len(kept) > 1 and not _is_acronym(kept[-1], all_caps):
        last = kept[-1]
        if last.lower() not in _NEGATIONS and not _ORDINAL.fullmatch(last):
            break
        kept.pop()
    return kept


def _spaced_variants(query: str) -> list[str]:
    words = _strip_special(query).split()
    all_caps = " ".join(words).isupper()
    # Every cleaning step goes into the first variant; one that would leave nothing is skipped.
    words = _drop_years(words) or words
    words = _drop_fillers(words, all_caps) or words
    cuts = [_cut(words, limit, all_caps) for limit in _WORD_CUTS]
    return [" ".join(w) for w in (words, *cuts) if w]


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
    stripped = _tidy_unspaced("".join(chars))
    # Both cleaning steps go into the first variant; dropping years is skipped if it empties.
    cleaned = _tidy_unspaced(_CJK_YEAR.sub(" ", stripped)) or stripped
    variants = [cleaned]
    # Each segment ends where a separator run starts; prefixes keep the original separators.
    ends = [m.start() for m in _SEPARATOR_RUN.finditer(cleaned)]
    for end in reversed(ends):
        variants.append(cleaned[:end])
    first = cleaned[: ends[0]] if ends else cleaned
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
