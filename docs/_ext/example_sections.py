"""A griffe extension for the API reference: the package's docstrings, read as written.

- ``Example:`` heads the package's doctests; griffe's Google parser knows only
  ``Examples:`` and would render the doctest lines as Markdown text.
- Sphinx roles (``:func:`name```, ``:class:`~mod.Name```) become inline code, so they
  do not show as raw markup.
- Items naming several parameters at once (``start_token, end_token: ...``) keep
  their names together instead of being split into a name and a type.
"""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.M)
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")
_NAMES = re.compile(r"^(\s+)([A-Za-z_]\w*(?:, [A-Za-z_]\w*)+)(:\s)", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is None:
            return
        text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
        text = _ROLE.sub(r"`\1`", text)
        text = _NAMES.sub(lambda m: m[1] + m[2].replace(", ", ",\u00a0") + m[3], text)
        obj.docstring.value = text
