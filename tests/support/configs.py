"""Config spellings the tests share."""

from __future__ import annotations


def flat_form(table: dict) -> dict:
    """A sectioned config table in the flat spelling an older pflkit wrote (keys without a flat
    alias, such as partition.max_retries, are left out, as those files never had them)."""
    from pflkit.config import FLAT_KEYS, SECTIONS

    alias = {target: key for key, target in FLAT_KEYS.items()}
    out = {k: v for k, v in table.items() if k not in SECTIONS}
    for section in SECTIONS:
        out.update({alias[(section, f)]: v for f, v in table[section].items() if (section, f) in alias})
    return out
