"""A griffe extension for the API reference: read ``Example:`` as an examples section.

The package's docstrings head their doctests ``Example:``; griffe's Google parser
knows only ``Examples:`` and would render the doctest lines as Markdown text.
"""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
