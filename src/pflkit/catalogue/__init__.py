"""The catalogue of methods as users read it: ``pflkit algorithms`` and the documentation pages,
made from each method's card (``pflkit.algorithms.card``) and what its class states in code."""

from .entries import Entry, entries, entry, names, settings_rows, vmap_mode
from .listing import format_listing, listing
from .pages import Costs, load_costs, page_names, render_method_page, render_methods_index

__all__ = [
    "Costs",
    "Entry",
    "entries",
    "entry",
    "format_listing",
    "listing",
    "load_costs",
    "names",
    "page_names",
    "render_method_page",
    "render_methods_index",
    "settings_rows",
    "vmap_mode",
]
