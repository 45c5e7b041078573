"""Sphinx configuration of the fp4 docs site (`nox -s docs`, warnings are errors)."""

import re

project = "fp4"
author = "fp4 developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "results"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
# The signatures show the type annotations; the aliases of "any array of these kinds" keep
# their names (explained on the API pages) instead of printing as Any, and numpy's ArrayLike
# its name instead of its expansion.
autodoc_typehints = "signature"
autodoc_type_aliases = {name: name for name in ("Array", "DType", "Device", "TensorLike")}
autodoc_type_aliases["npt.ArrayLike"] = "numpy.typing.ArrayLike"
html_theme = "alabaster"
nitpicky = False
# Straight quotes: values quoted in docstrings ("nvfp4") stay what a user types.
smartquotes = False


def _alias_names(app, what, name, obj, options, signature, return_annotation):
    """Sphinx 9 prints an alias inside a union (``Array | None``) as
    ``TypeAliasForwardRef('Array')``: print its name, as it does outside unions."""

    def fix(text):
        return text and re.sub(r"TypeAliasForwardRef\('([\w.]+)'\)", r"\1", text)

    return fix(signature), fix(return_annotation)


def setup(app):
    app.connect("autodoc-process-signature", _alias_names)
