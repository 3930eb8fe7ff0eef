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

import functools
import unicodedata
from dataclasses import dataclass

import numpy as np

# Invisible characters outside category Cf: the combining grapheme joiner, the Hangul fillers,
# the Mongolian free variation selectors and the variation selectors.
_INVISIBLE = {0x034F, 0x115F, 0x1160, 0x3164, 0xFFA0, 0x180B, 0x180C, 0x180D, 0x180F,
              *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)}
# Planes 0-2 and 14 (tags, variation selectors supplement): where every assigned compatibility
# character, format character and confusable lives.
_PLANES = (range(0x80, 0x30000), range(0xE0000, 0xE1000))


def _fold_char(ch: str, ascii_of: dict[str, str]) -> str:
    category = unicodedata.category(ch)
    if ord(ch) in _INVISIBLE or category == "Cf":
        return ""
    if category in ("Mn", "Me"):  # a combining mark on its own: what NFKD would drop
        return ""
    if unicodedata.decomposition(ch):
        bare = "".join(c for c in unicodedata.normalize("NFKD", ch)
                       if not unicodedata.combining(c))
        ch = unicodedata.normalize("NFKC", bare)
    return "".join(ascii_of.get(c, c) for c in ch)


@functools.cache
def _tables() -> tuple[dict[int, str], np.ndarray]:
    """(str.translate table of every character that folds to something else, the length of
    each code point's fold). Built once (about a second): when a policy loads."""
    from confusable_homoglyphs.confusables import confusables_data  # a 2 MB table: on first use

    ascii_of = {}
    for ch, alternatives in confusables_data.items():
        if len(ch) == 1 and not ch.isascii():
            for alt in alternatives:
                if len(alt["c"]) == 1 and alt["c"].isascii() and alt["c"].isalnum():
                    ascii_of[ch] = alt["c"]
                    break
    table = {}
    lengths = np.ones(0x110000, np.int64)
    for plane in _PLANES:
        for cp in plane:
            ch = chr(cp)
            folded = _fold_char(ch, ascii_of)
            if folded != ch:
                table[cp] = folded
                lengths[cp] = len(folded)
    return table, lengths


@functools.cache
def _sources() -> dict[str, str]:
    """Per character: itself and every character that folds to it alone (its look-alikes)."""
    table, _ = _tables()
    sources: dict[str, str] = {}
    for cp, folded in table.items():
        if len(folded) == 1:
            sources[folded] = sources.get(folded, folded) + chr(cp)
    return sources


def look_alikes(ch: str) -> str:
    """`ch` and the characters that fold to it: what a literal's character matches in text
    that is not folded (a model's output)."""
    return _sources().get(ch, ch)


# Characters a fold drops that may stand between a literal's letters in unfolded text.
IGNORABLE = r"[\p{Cf}\p{Mn}\p{Me}\u034f\u115f\u1160\u3164\uffa0\u180b-\u180d\u180f]"


def prepare() -> None:
    """Build the tables now (at policy load) rather than in the first request."""
    _tables()


@dataclass(frozen=True, eq=False)
class Folded:
    """`text` folded, and where its characters came from. `_at[k]` is the original index of the
    k-th character that folded to other than one character, `_from[k]` where its fold starts in
    `text` and `_len[k]` its length; every other character maps one to one."""

    text: str
    _at: np.ndarray | None = None
    _from: np.ndarray | None = None
    _len: np.ndarray | None = None

    def _origin(self, i: int) -> int:
        if self._at is None:
            return i
        k = int(np.searchsorted(self._from, i, side="right")) - 1
        if k < 0:
            return i
        end = int(self._from[k] + self._len[k])
        return int(self._at[k]) if i < end else int(self._at[k]) + 1 + (i - end)

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original text's span of text[start:end] (end > start)."""
        return self._origin(start), self._origin(end - 1) + 1


def fold(text: str) -> Folded:
    """`text` folded (see the module). Linear, in C and numpy: no Python loop per character."""
    if text.isascii():
        return Folded(text)
    table, lengths = _tables()
    folded = text.translate(table)
    code_points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
    fold_lengths = lengths[code_points]
    at = np.flatnonzero(fold_lengths != 1)
    if not len(at):
        return Folded(folded)
    lens = fold_lengths[at]
    # Where each of them starts in the folded text: its index, plus what those before it
    # added or took away.
    starts = at + np.concatenate(([0], np.cumsum(lens - 1)[:-1]))
    return Folded(folded, at, starts, lens)
