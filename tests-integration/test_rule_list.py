"""``RULES`` is the one source of the rule list: the places that repeat it agree with it.

The ``DMuon`` docstring's list of matrix rules, the table of the algorithms index
(``docs/algorithms/index.md``) and the rule pages of the mkdocs navigation name the
rules of :data:`dmuon.optim.RULES`, in its order, each with its page. Adding a rule
to ``rules.py`` without its page and rows fails here, and so does a stale row. Each
rule page's "Hyperparameters" table lists the rule's own options with their defaults
(:attr:`Rule.options`), and its "State" table the buffers the rule declares
(:meth:`Rule.state_specs`) and ``step``.
"""

from __future__ import annotations

import ast
import itertools
import pathlib
import re

from dmuon.optim import RULES, DMuon

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOT_RULES = ("index", "coefficients")  # the other pages of the Algorithms section


def docstring_rules(doc: str) -> list[str]:
    """The rule names the docstring lists after "a matrix rule" (up to "; the default")."""
    text = " ".join(doc.split())
    listed = re.search(r"a matrix rule \((.*?); the default", text)
    assert listed, "the DMuon docstring no longer lists the matrix rules"
    return re.findall(r'``"(\w+)"``', listed.group(1))


def table_rules(markdown: str) -> list[str]:
    """The rules of the algorithms index table, by their first column."""
    return [name for name, _ in re.findall(r"^\| \[`(\w+)`\]\((\w+)\.md\) \|", markdown, re.M)]


def nav_rules(mkdocs_yml: str) -> list[str]:
    """The rule pages of the mkdocs navigation, in order."""
    pages = re.findall(r"^\s+- (?:[^:\n]+: )?algorithms/(\w+)\.md\s*$", mkdocs_yml, re.M)
    return [p for p in pages if p not in NOT_RULES]


def page_tables(markdown: str) -> dict[str, dict[str, str]]:
    """A rule page's ``| key | default | meaning |`` and ``| key | shape | meaning |``
    tables, as ``{"default": {key: cell}, "shape": {key: cell}}``."""
    tables: dict[str, dict[str, str]] = {}
    head = r"^\| key \| (default|shape) \| meaning \|\n\|[-|]+\|\n((?:\|.*\|\n)+)"
    for m in re.finditer(head, markdown, re.M):
        rows = tables.setdefault(m.group(1), {})
        for line in m.group(2).splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            key = re.fullmatch(r"`(\w+)`", cells[0])
            if key:
                rows[key.group(1)] = cells[1]
    return tables


def documented_defaults(markdown: str) -> dict[str, object]:
    """The "default" column of a rule page, each cell read as a Python literal."""
    cells = page_tables(markdown).get("default", {})
    return {k: ast.literal_eval(v.strip("`")) for k, v in cells.items()}


def test_each_rule_page_lists_its_options_with_the_code_defaults():
    for name, rule in RULES.items():
        text = (ROOT / "docs" / "algorithms" / f"{name}.md").read_text()
        options = {k: o.default for k, o in rule.options.items()}
        documented = documented_defaults(text)
        assert documented == options, f"{name}.md's Hyperparameters table differs from the code"
        for k, v in documented.items():  # 1 == 1.0 == True: the types must agree too
            assert type(v) is type(options[k]), f"{name}.md: {k} = {v!r}, code: {options[k]!r}"


def test_each_rule_page_lists_the_state_the_rule_declares():
    for name, rule in RULES.items():
        text = (ROOT / "docs" / "algorithms" / f"{name}.md").read_text()
        state = list(page_tables(text).get("shape", {}))
        assert state == [s.name for s in rule.state_specs()] + ["step"], f"{name}.md's State table"


def rules_docstring(source: str) -> str:
    """The attribute docstring of ``RULES`` in ``rules.py`` (the string after it)."""
    body = ast.parse(source).body
    for node, after in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "RULES":
            assert isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            return str(after.value.value)
    raise AssertionError("rules.py no longer documents RULES")


def test_the_rules_docstring_names_every_rule_in_order():
    import dmuon.optim.rules as rules

    doc = rules_docstring(pathlib.Path(rules.__file__).read_text())
    assert re.findall(r"``(\w+)``", doc.split(":", 1)[1].split(". ")[0]) == list(RULES)


def test_the_docstring_lists_every_rule_in_order():
    assert docstring_rules(DMuon.__doc__ or "") == list(RULES)


def test_the_algorithms_table_has_one_row_per_rule_in_order():
    text = (ROOT / "docs" / "algorithms" / "index.md").read_text()
    assert table_rules(text) == list(RULES)
    for name, page in re.findall(r"^\| \[`(\w+)`\]\((\w+)\.md\) \|", text, re.M):
        assert name == page, f"the row of {name!r} links {page}.md"


def test_the_navigation_has_one_page_per_rule_in_order():
    assert nav_rules((ROOT / "mkdocs.yml").read_text()) == list(RULES)
    for name in RULES:
        assert (ROOT / "docs" / "algorithms" / f"{name}.md").is_file(), f"no page for {name!r}"


def test_the_checks_fail_on_a_drifted_list():
    doc = 'a matrix rule (``"muon"``, ``"normuon"``; the default is ``rule``)'
    assert docstring_rules(doc) != list(RULES)
    table = "| [`muon`](muon.md) | x | — | y |\n| [`extra`](extra.md) | x | — | y |\n"
    assert table_rules(table) != list(RULES)
    nav = "      - algorithms/index.md\n      - Muon: algorithms/muon.md\n"
    assert nav_rules(nav) == ["muon"] != list(RULES)
    page = "| key | default | meaning |\n|---|---|---|\n| `beta2` | `0.9` | decay |\n"
    assert (
        documented_defaults(page)
        == {"beta2": 0.9}
        != {k: o.default for k, o in RULES["normuon"].options.items()}
    )


def common_keys_table(markdown: str) -> dict[str, str]:
    """Key → documented default of the "Hyperparameters common to every matrix rule" table
    of the algorithms index (a row may name several keys, with as many defaults)."""
    section = markdown.split("## Hyperparameters common to every matrix rule", 1)[1]
    section = section.split("\n## ", 1)[0]
    table: dict[str, str] = {}
    for keys, defaults in re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", section, re.M):
        names = re.findall(r"`(\w+)`", keys)
        values = [v.strip().strip("`") for v in defaults.split(",")]
        assert len(values) == len(names), f"row {keys}: {len(names)} keys, defaults {defaults}"
        table.update(zip(names, values, strict=True))
    return table


def test_common_keys_table_is_matrix_keys_with_the_constructors_defaults():
    # every common group key is documented, none that is not one, and a key the
    # constructor takes shows the constructor's default
    import inspect

    from dmuon.optim.hyperparameters import MATRIX_KEYS

    table = common_keys_table((ROOT / "docs" / "algorithms" / "index.md").read_text())
    assert sorted(table) == sorted(MATRIX_KEYS)
    signature = inspect.signature(DMuon.__init__).parameters
    for key, shown in table.items():
        if key in signature:  # "1e-3", "True", '"gram"' read as Python literals
            assert ast.literal_eval(shown) == signature[key].default, (key, shown)
