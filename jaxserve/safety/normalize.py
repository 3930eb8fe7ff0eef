"""Text as the input rules match it (review a70e490, M1): a literal must not be beaten by a
zero-width space, a soft hyphen, a fullwidth or accented letter, or a Cyrillic look-alike.

Each character is folded on its own: format characters (Unicode category Cf: zero-width spaces
and joiners, the soft hyphen, bidi controls) and variation selectors are dropped; the rest is
NFKD-decomposed, its combining marks dropped, NFKC-composed again, and a non-ASCII letter or
digit that Unicode lists as confusable with an ASCII one (confusables.txt, through the
confusable-homoglyphs package) becomes that ASCII character. Whitespace is left as it is: a
literal's spaces match any run of whitespace instead (policy.py). Folding one character at a
time keeps a map back to the original text, so a redaction found in the folded text replaces the
original characters; the model is never shown the folded text.
"""

from __future__ import annotations

import bisect
import functools
import unicodedata
from dataclasses import dataclass

import regex

# Invisible characters outside category Cf: the combining grapheme joiner, the Hangul fillers,
# the Mongolian free variation selectors and the variation selectors.
_INVISIBLE = {0x034F, 0x115F, 0x1160, 0x3164, 0xFFA0, 0x180B, 0x180C, 0x180D, 0x180F,
              *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)}
# Planes 0-2 and 14 (tags, variation selectors supplement): where every assigned compatibility
# character, format character and confusable lives.
_PLANES = (range(0x80, 0x30000), range(0xE0000, 0xE1000))


def _fold_char(ch: str, ascii_of: dict[str, str]) -> str:
    if ord(ch) in _INVISIBLE or unicodedata.category(ch) == "Cf":
        return ""
    bare = "".join(c for c in unicodedata.normalize("NFKD", ch)
                   if not unicodedata.combining(c))
    bare = unicodedata.normalize("NFKC", bare)
    return "".join(ascii_of.get(c, c) for c in bare)


@functools.cache
def _tables() -> tuple[dict[int, str], regex.Pattern | None]:
    """(str.translate table of every character that folds to something else, a pattern of those
    that fold to other than one character). Built once, on first use (about 0.1 s)."""
    from confusable_homoglyphs.confusables import confusables_data  # a 2 MB table: on first use

    ascii_of = {}
    for ch, alternatives in confusables_data.items():
        if len(ch) == 1 and not ch.isascii():
            for alt in alternatives:
                if len(alt["c"]) == 1 and alt["c"].isascii() and alt["c"].isalnum():
                    ascii_of[ch] = alt["c"]
                    break
    table = {}
    for plane in _PLANES:
        for cp in plane:
            ch = chr(cp)
            folded = _fold_char(ch, ascii_of)
            if folded != ch:
                table[cp] = folded
    uneven = "".join(regex.escape(chr(cp)) for cp, f in table.items() if len(f) != 1)
    return table, regex.compile(f"[{uneven}]") if uneven else None


@dataclass(frozen=True)
class Folded:
    """`text` folded, and where its characters came from: pieces alternate between one original
    character folded to other than one character (even) and a run that maps one to one (odd)."""

    text: str
    original_length: int
    _starts: tuple[int, ...] = ()  # where each piece starts in `text`
    _origins: tuple[int, ...] = ()  # and in the original

    def _origin(self, i: int) -> int:
        k = bisect.bisect_right(self._starts, i) - 1
        if k < 0:
            return i
        return self._origins[k] + (i - self._starts[k] if k % 2 else 0)

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original text's span of text[start:end] (end > start)."""
        return self._origin(start), self._origin(end - 1) + 1


def fold(text: str) -> Folded:
    if text.isascii():
        return Folded(text, len(text))
    table, uneven = _tables()
    folded = text.translate(table)
    if uneven is None or (first := uneven.search(text)) is None:
        return Folded(folded, len(text))
    starts, origins, at = [], [], 0
    last = 0  # where the original's current one-to-one run began
    for m in uneven.finditer(text, first.start()):
        i = m.start()
        at += i - last
        starts.append(at)
        origins.append(i)
        at += len(table[ord(text[i])])
        starts.append(at)
        origins.append(i + 1)
        last = i + 1
    return Folded(folded, len(text), tuple(starts), tuple(origins))
