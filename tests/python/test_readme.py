"""The README's two commands are what CI runs, unchanged, with nothing
between them; and the README's links lead somewhere.

The set-up command is the ```bash block after `<!-- set-up command -->` in
README.md, the test command the one after `<!-- test command -->`. `.ci/run`
must run each as one line, character for character, the set-up command
first, with no command between them (a `pip install` or an exported
variable there would make a pass that the README's reader does not get).
The README's other blocks run with the docs' (test_docs.py).
"""

from __future__ import annotations

import re

from launchers import REPO

README = (REPO / "README.md").read_text()
CI = (REPO / ".ci" / "run").read_text().splitlines()


def command(marker: str) -> str:
    m = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)\n```", README, re.DOTALL)
    assert m, f"README.md has no ```bash block after <!-- {marker} -->"
    body = m.group(1)
    assert "\n" not in body, f"the {marker} is one line; README.md has:\n{body}"
    return body


def test_ci_runs_the_readme_commands_unchanged_and_nothing_between():
    setup, test = command("set-up command"), command("test command")
    assert setup.startswith("python3 -m pip install torch==2.13.0 "), "torch (a pinned CPU-capable build) is installed first"
    assert "'.[test,docs]'" in setup, "the set-up command installs what the test command needs"
    assert CI.count(setup) == 1, f".ci/run does not run the README's set-up command as one line:\n{setup}"
    assert CI.count(test) == 1, f".ci/run does not run the README's test command as one line:\n{test}"
    first, second = CI.index(setup), CI.index(test)
    assert first < second
    between = [line for line in CI[first + 1 : second] if line.strip() and not line.lstrip().startswith("#")]
    assert not between, f".ci/run runs commands between the README's two: {between}"
    # Nothing before the set-up command installs or exports anything either.
    before = [line for line in CI[:first] if not line.lstrip().startswith("#")]
    assert not [line for line in before if re.search(r"\bpip\b|\bexport\b|^\s*[A-Z_]+=", line)], before
    assert any("python3 -m venv" in line for line in before), ".ci/run makes a fresh virtual environment"


def test_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 160
    links = re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", README)
    assert links
    for link in links:
        assert (REPO / link).exists(), f"README.md links to {link}, which does not exist"
