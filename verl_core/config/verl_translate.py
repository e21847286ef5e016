"""Reading the table of verl's names (:mod:`.verl_names`): one verl key's :class:`Translation`, a set
of overrides translated at once (conversions may read the other keys given), and suggestions for an
unknown key that never cross a known confusion (:data:`.verl_names.CONFUSIONS`)."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from verl_core.config.verl_names import (
    BUILT_IN,
    CONFUSIONS,
    CONVERTED,
    DROPPED,
    RENAMED,
    RENAMED_PREFIXES,
    SECTIONS,
    Refused,
    load_value,
)


@dataclass(frozen=True)
class Translation:
    """What one verl key became: our settings (key, value text), or dropped, with the reason."""

    verl_key: str
    value: str
    settings: tuple[tuple[str, str], ...]
    note: str = ""
    dropped: bool = False

    def line(self) -> str:
        """``verl key X → Y`` (one line, as ``config show`` and ``from-verl`` print it)."""
        if self.dropped:
            return f"verl key {self.verl_key} dropped: {self.note}"
        became = ", ".join(f"{k}={v}" for k, v in self.settings) or "nothing to set"
        return f"verl key {self.verl_key} → {became}" + (f" ({self.note})" if self.note else "")


def verl_forms(key: str) -> list[str]:
    """``key`` and, for a key written in our sections with verl's remainder (``rollout.log_prob_micro_
    batch_size_per_gpu``, ``model.use_remove_padding``), the verl key it stands for."""
    forms = [key]
    for verl, ours in SECTIONS.items():
        if key.startswith(ours):
            forms.append(verl + key.removeprefix(ours))
    return forms


def _dropped(key: str) -> str | None:
    if key in DROPPED:
        return DROPPED[key]
    return next((why for p, why in DROPPED.items() if p.endswith(".") and key.startswith(p)), None)


def translate_one(
    key: str, text: str, given: Mapping[str, str], is_ours: Callable[[str], bool]
) -> Translation | None:
    """The translation of verl's ``key=text``; None when the key is ours (and not converted) or unknown.
    ``given``: every key of the same set of overrides with its text (cross-key conversions)."""
    mine = is_ours(key)  # ours: read as ours unless CONVERTED names the key itself
    for form in [key] if mine else verl_forms(key):
        if form in CONVERTED:
            convert, note = CONVERTED[form]
            try:
                return Translation(key, text, tuple(convert(text, given)), note)
            except Refused as e:
                return Translation(key, text, (), str(e), dropped=True)
    if mine:
        return None
    for form in verl_forms(key):
        if form in RENAMED:
            return Translation(key, text, ((RENAMED[form], text),))
        for verl, ours in RENAMED_PREFIXES.items():
            if form.startswith(verl):
                return Translation(key, text, ((ours + form.removeprefix(verl), text),))
        if form in BUILT_IN:
            value, does = BUILT_IN[form]
            if load_value(text) == value:
                return Translation(key, text, (), f"built in: {does}")
            return Translation(key, text, (), f"{load_value(text)!r} is not available: {does}", dropped=True)
        why = _dropped(form)
        if why is not None:
            return Translation(key, text, (), why, dropped=True)
    for verl, ours in SECTIONS.items():
        if key.startswith(verl) and is_ours(ours + key.removeprefix(verl)):
            return Translation(key, text, ((ours + key.removeprefix(verl), text),))
    return None


def translate(
    pairs: Iterable[tuple[str, str]], is_ours: Callable[[str], bool]
) -> tuple[list[tuple[str, str]], list[Translation], list[str]]:
    """Our (key, text) settings in the given order, the translations made, and the keys neither ours
    nor in the table (for the caller's unknown-key error)."""
    pairs = list(pairs)
    given = dict(pairs)
    settings: list[tuple[str, str]] = []
    made: list[Translation] = []
    unknown: list[str] = []
    for key, text in pairs:
        t = translate_one(key, text, given, is_ours)
        if t is not None and not (t.settings == ((key, text),) and not t.dropped):
            made.append(t)
            settings.extend(t.settings)
        elif t is not None or is_ours(key):
            settings.append((key, text))
        else:
            unknown.append(key)
    return settings, made, unknown


def confused(a: str, b: str) -> bool:
    """Whether names ``a`` and ``b`` differ in a word of :data:`CONFUSIONS` (micro vs mini, ...)."""

    def has(name: str, word: str) -> bool:
        return f"_{word}_" in "_" + name.replace(".", "_") + "_"

    return any(
        (has(a, x) and not has(a, y) and has(b, y) and not has(b, x))
        or (has(a, y) and not has(a, x) and has(b, x) and not has(b, y))
        for x, y in CONFUSIONS
    )


def known_verl_keys() -> list[str]:
    """Every verl key the table names (prefixes without their trailing dot)."""
    return [k.rstrip(".") for k in (*RENAMED, *CONVERTED, *BUILT_IN, *DROPPED)]


def suggest(key: str, candidates: Iterable[str]) -> str | None:
    """The closest of ``candidates`` (our keys, or the table's verl keys) to ``key`` whose meaning is
    not another's: difflib's near names among its siblings, less those across a known confusion."""
    parent, _, last = key.rpartition(".")
    names = [c for c in candidates if c != key]
    siblings = {c.rpartition(".")[2]: c for c in names if c.rpartition(".")[0] == parent}
    for cutoff in (0.75, 0.6):
        for close in difflib.get_close_matches(last, list(siblings), n=8, cutoff=cutoff):
            if not confused(key, siblings[close]):
                return siblings[close]
    return None
