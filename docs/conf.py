"""Sphinx configuration of the fp4 docs site (`nox -s docs`, warnings are errors)."""

project = "fp4"
author = "fp4 developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "results"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "none"
html_theme = "alabaster"
nitpicky = False
# Straight quotes: values quoted in docstrings ("nvfp4") stay what a user types.
smartquotes = False
