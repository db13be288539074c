"""The built documentation site, served on localhost and opened in headless Chromium.

`nox -s docs` builds the site (`mkdocs build --strict`) and runs this file against it;
alone: `DMUON_SITE_DIR=site python -m pytest docs/tests`. The browser is Debian's
`chromium` driven through Debian's `chromium-driver` (the two come from one source
package, so their versions always match); nothing is downloaded. Without them the tests
skip and say how to install them, unless DMUON_SITE_TEST_REQUIRE_BROWSER is set (CI),
where they fail.

To extend: a package's API page gets a row in API_PAGES for each class or function it
must render; the site search gets a row in SEARCH_HITS for each term it must find.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import pathlib
import re
import shutil
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from html import unescape

import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

ROOT = pathlib.Path(__file__).resolve().parents[2]
SITE = pathlib.Path(os.environ.get("DMUON_SITE_DIR", ROOT / "site"))
CHROMIUM = pathlib.Path(os.environ.get("DMUON_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = pathlib.Path(os.environ.get("DMUON_CHROMEDRIVER", "/usr/bin/chromedriver"))
REQUIRE_BROWSER = bool(os.environ.get("DMUON_SITE_TEST_REQUIRE_BROWSER"))
SCREENSHOTS = os.environ.get("DMUON_SITE_SCREENSHOTS")  # a folder: keep PNGs of what was seen
WAIT = 20.0  # seconds for a page or the search worker; a healthy site needs well under one

# page -> (object kind as mkdocstrings renders it, name in its heading) that must be on it.
API_PAGES: dict[str, list[tuple[str, str]]] = {
    "api/kernels/": [
        ("function", "orthogonalize"),
        ("function", "gram_newton_schulz"),
        ("function", "newton_schulz"),
        ("class", "CoefficientSet"),
        ("function", "polar_factor"),
        ("function", "syrk"),
        ("class", "Autotuner"),
    ],
    "api/comm/": [
        ("class", "OwnerPlan"),
        ("function", "plan_owners"),
        ("class", "MatrixItem"),
        ("function", "reduce_to_owners"),
        ("function", "majority_vote"),
        ("function", "run_on_ranks"),
    ],
    "api/optim/": [("class", "DMuon"), ("function", "param_groups")],
    "api/integrations/": [
        ("module", "dmuon.integrations"),
        ("function", "dedicate"),
        ("function", "save"),
        ("function", "check"),
        ("function", "initialize"),
        ("function", "save_checkpoint"),
        ("function", "load_checkpoint"),
    ],
}

# What a reader types into the search box -> a link the results must hold, relative to the
# site root (a trailing * : a link starting with it).
SEARCH_HITS: list[tuple[str, str]] = [
    ("DMuon", ""),
    ("DMuon", "api/optim/#dmuon.optim.DMuon"),
    ("orthogonalize", "api/kernels/#dmuon.kernels.orthogonalize.orthogonalize"),
    ("plan_owners", "api/comm/#dmuon.comm.plan_owners"),
    ("OwnerPlan", "api/comm/#dmuon.comm.OwnerPlan"),
    ("dmuon-plan", "guides/planning/*"),
    ("step-time model", "concepts/step-model/*"),
]

# Nothing here may hang: each test (browser start included) gets a hard limit.
pytestmark = pytest.mark.timeout(180)

CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",  # Chromium refuses to run as root with its sandbox
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # the machine's network is closed: no phoning home
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",  # containers have a tiny /dev/shm
    "--window-size=1280,1000",  # desktop layout: the search box sits in the header
)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site_url() -> Iterator[str]:
    if not (SITE / "index.html").is_file():
        pytest.fail(f"no built site in {SITE}: run `mkdocs build` first (nox -s docs does)")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    if missing:
        message = (
            f"headless Chromium is not installed ({', '.join(missing)} missing): "
            "apt-get install chromium chromium-driver (nox -s docs does this when run as root)"
        )
        if REQUIRE_BROWSER:
            pytest.fail(message)
        pytest.skip(message)
    profile = tempfile.mkdtemp(prefix="dmuon-site-test-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _open(browser: webdriver.Chrome, url: str) -> None:
    browser.get(url)
    WebDriverWait(browser, WAIT).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )


def _screenshot(browser: webdriver.Chrome, name: str) -> None:
    if SCREENSHOTS:
        pathlib.Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(pathlib.Path(SCREENSHOTS) / f"{name}.png"))


def _console_errors(browser: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def _heading_name(obj: WebElement) -> str:
    """The object's name in its heading, without the module path (shown at the top level)."""
    text = obj.find_element(By.CSS_SELECTOR, ".doc-heading .doc-object-name").text
    return text.rsplit(".", 1)[-1] if text.startswith("dmuon.") and " " not in text else text


def _without_query(link: str) -> str:
    """Material adds ?h=<query> (to highlight it) between the path and the #anchor."""
    parts = urllib.parse.urlsplit(link)
    return urllib.parse.urlunsplit(parts._replace(query=""))


def _pages() -> list[str]:
    """Every page of the site, from the search index mkdocs wrote."""
    index = json.loads((SITE / "search" / "search_index.json").read_text())
    return sorted({doc["location"].split("#")[0] for doc in index["docs"]})


# The pages in this many parts, one test each: `nox -s docs` runs the tests on two
# workers (pytest-xdist), each with its own browser, and this test is the longest.
PAGE_PARTS = 2


@pytest.mark.parametrize("part", range(PAGE_PARTS))
def test_every_page_loads_with_its_images_and_no_console_errors(browser, site_url, part):
    pages = _pages()
    assert len(pages) >= 10, pages  # the nav has at least this many pages
    broken: dict[str, object] = {}
    for page in pages[part::PAGE_PARTS]:
        _open(browser, site_url + page)
        title = browser.find_element(By.CSS_SELECTOR, "article h1").text
        images = browser.execute_script(
            "return Array.from(document.images)"
            ".filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"
        )
        errors = _console_errors(browser)
        if not title or images or errors:
            broken[page or "/"] = {"h1": title, "broken images": images, "console": errors}
    assert not broken, broken


@pytest.mark.parametrize("page", sorted(API_PAGES))
def test_api_page_renders_its_classes_and_functions(browser, site_url, page):
    _open(browser, site_url + page)
    _screenshot(browser, page.strip("/").replace("/", "-"))
    missing = []
    for kind, name in API_PAGES[page]:
        # mkdocstrings: <div class="doc doc-object doc-KIND"><hN class="doc-heading">
        # <span class="doc-object-name">NAME</span> ... then <div class="doc-contents">.
        objects = browser.find_elements(By.CSS_SELECTOR, f"div.doc-object.doc-{kind}")
        rendered = [o for o in objects if _heading_name(o) in (name, name.rsplit(".", 1)[-1])]
        if not rendered:
            missing.append((kind, name, "no heading"))
            continue
        heading = rendered[0].find_element(By.CSS_SELECTOR, ".doc-heading")
        contents = rendered[0].find_element(By.CSS_SELECTOR, ".doc-contents")
        if not heading.is_displayed() or not contents.text.strip():
            missing.append((kind, name, "heading hidden or no docstring rendered"))
    assert not missing, f"{page}: {missing}"
    assert not _console_errors(browser)


@pytest.mark.parametrize(("query", "expected"), SEARCH_HITS)
def test_site_search_finds(browser, site_url, query, expected):
    _open(browser, site_url)
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.click()
    box.send_keys(query)
    want = site_url + expected.rstrip("*")

    def hit(link: str) -> bool:
        link = _without_query(link)
        return link.startswith(want) if expected.endswith("*") else link == want

    def result_links(driver: webdriver.Chrome) -> list[str] | None:
        links = driver.execute_script(
            "return Array.from(document.querySelectorAll('.md-search-result__list a'))"
            ".map(a => a.href)"
        )
        return links if any(hit(link) for link in links) else None

    with contextlib.suppress(TimeoutException):
        WebDriverWait(browser, WAIT).until(result_links)
    _screenshot(browser, f"search-{query}")
    links = browser.execute_script(
        "return Array.from(document.querySelectorAll('.md-search-result__list a')).map(a => a.href)"
    )
    meta = browser.find_element(By.CSS_SELECTOR, ".md-search-result__meta").text
    found = [_without_query(link) for link in links]
    assert any(hit(link) for link in links), (
        f"search {query!r} ({meta!r}) did not link {want}; it linked {found}"
    )


def test_no_search_term_keeps_a_digit():
    # lunr 2.3.9, Material's search engine, builds its term automaton with
    # TokenSet.fromArray and merges equal nodes by TokenSet.toString(): the final flag,
    # then each edge's character followed by its target's numeric id. A digit as an
    # edge's character makes that key ambiguous ("a" → node 123 and "a" → 1, "2" → 3
    # both read "0a123"), two different nodes are merged, and the automaton accepts
    # words never indexed and loses indexed ones: a query reaching one throws in the
    # worker ("Invalid query", TypeError reading '_index'). After an unrelated docs
    # change every search for "DMuon" and "dmuon-plan" found nothing that way. The
    # separator (mkdocs.yml) therefore splits terms on digits; check that it does,
    # tokenising every indexed document as the worker does.
    path = SITE / "search" / "search_index.json"
    if not path.is_file():
        pytest.skip(f"no built site at {SITE}: run mkdocs build first")
    index = json.loads(path.read_text())
    separator = re.compile(index["config"]["separator"])
    held = set()
    for doc in index["docs"]:
        for field in (doc["title"], doc["text"]):
            held.update(t for t in separator.split(field.lower()) if re.search("[0-9]", t))
    assert not held, f"{len(held)} search terms hold a digit, e.g. {sorted(held)[:5]}"


SNIPPET = "--8<--"


def test_every_included_script_is_in_its_built_page():
    # `ruff format` once rewrote the snippet lines into `--8 < --"…"`, which the
    # snippets extension leaves as text: the guides silently lost their scripts.
    pages = sorted((ROOT / "docs").rglob("*.md"))
    included = 0
    for page in pages:
        for line in page.read_text().splitlines():
            if not line.lstrip().startswith("--8"):
                continue
            assert line.startswith(f'{SNIPPET} "') and line.endswith('"'), (
                f"{page.relative_to(ROOT)}: malformed snippet line {line!r}; keep it "
                "between <!-- fmt: off --> and <!-- fmt: on --> so ruff leaves it alone"
            )
            target = ROOT / line[len(SNIPPET) + 2 : -1]
            assert target.is_file(), f"{page.relative_to(ROOT)} includes missing {target}"
            built = SITE / page.relative_to(ROOT / "docs").with_suffix("") / "index.html"
            if page.name == "index.md":
                built = SITE / page.relative_to(ROOT / "docs").with_name("index.html")
            if not built.is_file():
                pytest.skip(f"no built site at {SITE}: run mkdocs build first")
            html = built.read_text()
            assert "--8" not in html, f"{built}: the snippet marker was not replaced"
            text = unescape(re.sub(r"<[^>]+>", "", html))  # code is split into spans
            # the script's own first line of code (its docstring opening) is in the page
            first = next(t for t in target.read_text().splitlines() if t.strip())
            assert first.strip('"').strip()[:30] in text, f"{built} lacks {target.name}"
            included += 1
    assert included >= 4, f"only {included} included scripts found"


# Public names documented on the API pages besides each package's own __all__.
DOCUMENTED_MODULES = ("integrations/checkpoint/__init__.py", "integrations/deepspeed.py")


def _all_of(source: pathlib.Path) -> list[str]:
    """A module's literal ``__all__``, read without importing it (this venv has no torch)."""
    import ast

    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{source} has no literal __all__")


def test_every_public_name_has_an_entry_on_the_api_pages():
    # Each package's __all__ (and the integration modules users import by name) must be
    # reachable on the site: a mkdocstrings anchor ``id="dmuon....NAME"`` in a built page.
    pages = sorted((SITE / "api").glob("*/index.html"))
    if not pages:
        pytest.fail(f"no built API pages in {SITE / 'api'}: run `mkdocs build` first")
    anchors = {a for p in pages for a in re.findall(r'id="(dmuon\.[\w.]+)"', p.read_text())}
    names = {a.rsplit(".", 1)[-1] for a in anchors}
    sources = {
        f"packages/dmuon-{pkg}/src/dmuon/{pkg}/__init__.py"
        for pkg in ("kernels", "comm", "optim", "integrations")
    } | {f"packages/dmuon-integrations/src/dmuon/{m}" for m in DOCUMENTED_MODULES}
    missing = []
    for source in sorted(ROOT / s for s in sources):
        for name in _all_of(source):
            submodule = source.parent / name
            if name == "__version__" or submodule.with_suffix(".py").exists() or submodule.is_dir():
                continue  # the version, and re-exported modules (their pages list them)
            if name not in names:
                missing.append(f"{source.relative_to(ROOT)}: {name}")
    assert not missing, f"public names without an entry on docs/api/*.md: {missing}"
