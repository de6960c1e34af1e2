"""The documentation's own links: every relative link in README.md, docs/, results/README.md and the role's README
names a file that exists and, with ``#anchor``, a heading of that file (GitHub's anchors), so that moving a section
cannot leave a reader at a dead link; and the interfaces the docs describe are the code's: the agent's settings with
their defaults (docs/agent.md), the CLI's flags, shim.attach's options (docs/shim.md), the TOML examples, the
protocol's ops, fields and error codes (docs/protocol.md)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "results" / "README.md", *REPO.glob("docs/*.md"),
                *REPO.glob("ansible/**/README.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, punctuation dropped, each space a hyphen.
    Usage: ``github_anchor('`job_share = "auto"`: the part') == 'job_share--auto-the-part'``"""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a linked heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor GitHub gives the page's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        a = github_anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def test_the_anchor_rule():
    assert github_anchor('`job_share = "auto"`: the part from the link\'s load') == \
        "job_share--auto-the-part-from-the-links-load"
    assert github_anchor("The benchmark (`bench/jobs.py`)") == "the-benchmark-benchjobspy"
    assert github_anchor("`slowdown`: the job furthest behind first") == "slowdown-the-job-furthest-behind-first"


def test_every_relative_link_resolves():
    assert len(PAGES) > 10
    cache: dict[Path, set[str]] = {}
    broken = []
    for page in PAGES:
        for line in _prose(page.read_text()):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO)}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md":
                    if dest not in cache:
                        cache[dest] = anchors(dest)
                    if anchor not in cache[dest]:
                        broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_python_examples_of_the_policies_run():
    """The README's and docs' Python examples that use only the policies (pure, no agent, no torch) run as
    written: an example that no longer runs is a newcomer's first error."""
    ran = 0
    for page in PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            if block.lstrip().startswith("from tensorlane.policies") and "torch" not in block:
                exec(compile(block, f"{page.name} example", "exec"), {})
                ran += 1
    assert ran >= 1


def _table(page: Path, header: str) -> dict[str, list[str]]:
    """The rows of every table of ``page`` whose header line is ``header``: ``{first cell without backticks:
    the other cells}`` (a first cell naming two, ``a`, `b``, gives a row for each)."""
    rows, inside = {}, False
    for line in _prose(page.read_text()):
        if line.strip() == header:
            inside = True
        elif inside and line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if set(cells[0]) <= set("-: "):
                continue
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name] = cells[1:]
        else:
            inside = False
    return rows


def test_the_toml_examples_pass_the_agents_check():
    """Every ```toml block of the docs is a config the agent accepts (a fragment without an interface gets one)."""
    import tomllib

    from tensorlane.agent.config import from_dict

    checked = 0
    for page in PAGES:
        for block in re.findall(r"```toml\n(.*?)```", page.read_text(), re.S):
            raw = tomllib.loads(block)
            if "interface" not in raw and "interfaces" not in raw:
                raw["interface"] = "eth0"
            from_dict(raw)
            checked += 1
    assert checked >= 4


def _documented_default(key: str, cell: str):
    """A default as docs/agent.md writes it (`"auto"`, 0.01, `[]`, none, true, `0660`, 0 (off), a bare path)."""
    import tomllib

    text = cell.replace("`", "").split(" (")[0]
    if key == "socket_mode":
        return int(text, 8)
    if text in ("none", "true", "false"):
        return {"none": None, "true": True, "false": False}[text]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a path or an address, unquoted


def test_the_agents_config_tables_name_every_setting_with_its_default():
    """docs/agent.md's settings tables list every setting of agent/config.py and no other, each with the
    dataclass's default, and the inline examples of their rows (``e.g. `{...}```) are accepted."""
    import tomllib

    from tensorlane.agent.config import _KEYS, ALIASES, _default, from_dict

    rows = _table(REPO / "docs" / "agent.md", "| field | default | meaning |")
    assert set(rows) == set(_KEYS) | set(ALIASES), sorted(set(rows) ^ (set(_KEYS) | set(ALIASES)))
    needs = {"job_priority": {"job_policy": "static"}, "job_intensity": {"job_policy": "intensity"},
             "training_subnets": {"interfaces": "auto"}}
    for key, (default, meaning) in rows.items():
        if key not in ALIASES and key != "dscp":  # dscp: the default table by name, its numbers are test_levels'
            code = _default(key)
            code = list(code) if isinstance(code, tuple) else code
            assert code == _documented_default(key, default), f"{key}: docs say {default}, the code {code!r}"
        for example in re.findall(r"e\.g\. `(\{[^`]*\}|\[[^`]*\])`", meaning):
            raw = {key: tomllib.loads(f"v = {example}")["v"], **needs.get(key, {})}
            from_dict(raw if "interfaces" in raw else {"interface": "eth0", **raw})


def test_the_commands_and_flags_in_the_docs_are_the_clis():
    """Every flag of `tensorlane SUBCOMMAND` is named in docs/agent.md, and every `tensorlane SUBCOMMAND --flag`
    the docs write exists."""
    from tensorlane.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if a.choices and "agent" in a.choices).choices
    flags = {name: {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
             for name, sub in subs.items()}
    agent_md = (REPO / "docs" / "agent.md").read_text()
    missing = [f"{name} {flag}" for name, fl in flags.items() for flag in sorted(fl)
               if not re.search(rf"(?<![\w-]){flag}(?![\w-])", agent_md)]
    assert not missing, f"not in docs/agent.md: {missing}"
    wrong = []
    for page in PAGES:
        for sub, rest in re.findall(r"\btensorlane (agent|status|verify)\b([^`\n]*)", page.read_text()):
            wrong += [f"{page.name}: tensorlane {sub} {f}" for f in re.findall(r"--[a-z][a-z-]*", rest)
                      if f not in flags[sub]]
    assert not wrong, wrong


def test_the_shims_options_table_is_attachs_signature():
    """docs/shim.md's options are the keyword arguments of ``shim.attach``, with its defaults where the table
    gives a literal one (read from the source: importing the shim needs torch, this test does not)."""
    import ast

    src = (REPO / "shim" / "ddp.py").read_text()
    attach = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "attach")
    args = attach.args
    positional = args.args[len(args.args) - len(args.defaults):]  # those with a default: all but the model
    params = {a.arg: d for a, d in zip(positional, args.defaults, strict=True)}
    params |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)}
    rows = _table(REPO / "docs" / "shim.md", "| option | default | meaning |")
    assert set(rows) == set(params), sorted(set(rows) ^ set(params))
    for name, (default, _meaning) in rows.items():
        literal = default.strip("`")
        if literal in ("None", "False", "True") or re.fullmatch(r"[\d.]+|\"\w+\"", literal):
            code = _named_value(REPO / "shim" / "ddp.py", params[name])
            assert ast.literal_eval(literal) == code, f"{name}: docs say {default}, the code {code!r}"


def _named_value(path: Path, node):
    """The value of a default as ``path`` writes it: a literal, or a constant it imports (``DEFAULT_LEVELS``, from
    ``tensorlane.policies.levels import ...``; ``report.INTERVAL_S``, from ``tensorlane.shim import report``), read
    from the source of the module that declares it (``_code_value``)."""
    import ast

    if isinstance(node, ast.Constant):
        return node.value
    folders = {"tensorlane.agent": "agent", "tensorlane.shim": "shim", "tensorlane.policies": "policies"}
    name, owner = (node.id, None) if isinstance(node, ast.Name) else (node.attr, node.value.id)
    for imp in ast.walk(ast.parse(path.read_text())):
        if isinstance(imp, ast.ImportFrom) and any((a.asname or a.name) == (owner or name) for a in imp.names):
            module = f"{imp.module}.{owner}" if owner else imp.module
            pkg = next(p for p in folders if module.startswith(p + "."))
            return _code_value(REPO / folders[pkg] / (module.removeprefix(pkg + ".").replace(".", "/") + ".py"),
                               name)
    raise AssertionError(f"{path.relative_to(REPO)}: cannot tell where {ast.unparse(node)} comes from")


def test_the_protocols_ops_fields_and_error_codes_are_the_agents():
    """docs/protocol.md's request table has a row per op of the protocol, each naming every field the parser
    accepts for it, and its list of error codes is every code the agent sends (a ``ProtocolError``, a refused
    connection, an error line of the server), and no other (read from the source: no agent needed)."""
    import ast

    from tensorlane.client import OPS

    rows = _table(REPO / "docs" / "protocol.md", "| op | fields | result |")
    assert set(rows) == set(OPS), sorted(set(rows) ^ set(OPS))
    parse = next(n for n in ast.parse((REPO / "agent" / "protocol.py").read_text()).body
                 if isinstance(n, ast.FunctionDef) and n.name == "parse_request")
    fields = next(ast.literal_eval(d) for d in ast.walk(parse) if isinstance(d, ast.Dict)
                  and any(isinstance(k, ast.Constant) and k.value == "register" for k in d.keys))
    missing = [f"{op}: {f}" for op, names in fields.items() for f in sorted(names)
               if f"`{f}`" not in rows[op][0]]
    assert not missing, f"fields the parser takes that docs/protocol.md's table does not name: {missing}"
    sent = set()
    for path in (REPO / "agent").rglob("*.py"):
        src = path.read_text()
        sent |= set(re.findall(r'ProtocolError\(\s*"(\w+)"', src))
        sent |= set(re.findall(r'_refuse\(sock, peer, "(\w+)"', src))
        sent |= set(re.findall(r'protocol\.error\(\w+, "(\w+)"', src))
    text = (REPO / "docs" / "protocol.md").read_text()
    paragraph = text[text.index("Error codes:"):].split("\n\n")[0]
    documented = set(re.findall(r"(?:^|[:,] )`(\w+)`", paragraph.replace("\n", " ")))
    assert sent >= {"bad_json", "internal", "busy", "idle_timeout", "rate_limited", "too_large"}, sorted(sent)
    assert documented == sent, f"docs only: {sorted(documented - sent)}, code only: {sorted(sent - documented)}"


QUOTED_SECTION = re.compile(r"\b((?:docs/)?[\w-]+\.md)\)?,? \"([^\"\n]{3,80})\"")


def _sections(page: Path) -> list[str]:
    """What a quoted reference may name on ``page``: its headings' and bold items' text, lower case, without backticks
    and quotes (a reference in quotes cannot quote: ``docs/jobs.md, "job_share = auto"``)."""
    lines = _prose(page.read_text())
    texts = [m.group(1) for line in lines if (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line))]
    texts += re.findall(r"\*\*([^*]+)\*\*", "\n".join(lines))
    return [re.sub(r"[`\"]", "", t).lower() for t in texts]


def test_quoted_section_references_name_a_section():
    """A reference by name, ``docs/agent.md, "Fairness"`` or ``([agent.md](agent.md), "Draining")``, in the docs, the
    code, the role or the rules, names a heading or a bold item of that page: a renamed section must not leave a
    reader looking for one that is not there (what the anchors of links get from test_every_relative_link_resolves)."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    cache: dict[Path, list[str]] = {}
    checked, broken = 0, []
    for name in tracked:
        if not name.endswith((".py", ".md", ".yml", ".yaml", ".j2", ".toml", ".sh")):
            continue
        for doc, section in QUOTED_SECTION.findall((REPO / name).read_text(errors="replace")):
            page = REPO / doc if doc.startswith("docs/") else REPO / "docs" / doc
            if not page.exists():
                continue  # (a README of its own folder, an example's file name)
            if page not in cache:
                cache[page] = _sections(page)
            checked += 1
            if not any(re.sub(r"[`\"]", "", section).lower() in text for text in cache[page]):
                broken.append(f'{name}: {doc}, "{section}"')
    assert checked >= 3
    assert not broken, "no such section: " + "; ".join(broken)


REPO_COMMAND = re.compile(r"python -m (bench\.\w+|testbed\.\w+|bench|testbed|dashboards\.build)(?![\w.])"
                          r"((?: [a-z][\w-]*)?)([^`#&|;\n]*)")
SUBCOMMANDS = ("bench", "bench.worker", "testbed")  # the first word after these is a subcommand (a benchmark's NAME)


def _snippets(page: Path) -> list[str]:
    """The page's inline code (a span may go on over a line break) and the lines of its code blocks."""
    text, code, fenced = [], [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        else:
            (code if fenced else text).append(line)
    return [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", "\n".join(text))] + code


def _help_options(argv: tuple[str, ...]) -> list[set[str]]:
    """The option groups (``{"-c", "--count"}``) that ``python -m ARGV --help`` lists, --help aside."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", *argv, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"python -m {' '.join(argv)} --help: {out.stderr[-500:]}"
    groups = []
    for line in out.stdout.splitlines():
        if re.match(r"^\s+-", line):
            names = {w.split()[0] for w in line.strip().split(", ") if w.startswith("-")}
            if not names & {"-h", "--help"}:
                groups.append(names)
    return groups


def test_the_repositorys_commands_in_the_docs_take_the_flags_they_are_given():
    """Every ``python -m bench|testbed|dashboards.build ...`` the docs write names a command that exists and flags it
    takes (its ``--help`` lists them: no benchmark runs), and a synopsis (``[--a A] [--b B] [--check]``) names every
    option the command has: a newcomer copying one must not meet "unrecognized arguments"."""
    helps: dict[tuple, list[set[str]]] = {}
    wrong, checked = [], 0
    for page in PAGES:
        for snippet in _snippets(page):
            for module, sub, rest in REPO_COMMAND.findall(snippet):
                sub = sub.strip()
                if not module.islower():
                    continue  # `python -m bench.NAME`: a placeholder
                if module not in SUBCOMMANDS:
                    rest, sub = f" {sub}{rest}", ""
                elif not sub:
                    continue  # `python -m bench`: the list of benchmarks; `python -m bench NAME`: any of them
                argv = (module, sub) if sub else (module,)
                if argv not in helps:
                    helps[argv] = _help_options(argv)
                known = set().union(*helps[argv])
                where = f"{page.relative_to(REPO)}: python -m {' '.join(argv)}"
                wrong += [f"{where} {flag}" for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)
                          if flag not in known]
                if rest.count("[--") >= 3:  # a synopsis, not an example with an optional flag
                    wrong += [f"{where}: its synopsis lacks {sorted(g)[-1]}" for g in helps[argv]
                              if not any(re.search(rf"(?<![\w-]){o}(?![\w-])", rest) for o in g)]
                checked += 1
    assert checked >= 20 and len(helps) >= 8, (checked, sorted(helps))
    assert not wrong, wrong


def test_the_guaranteed_rates_table_is_the_agents():
    """docs/agent.md's "Guaranteed rates" table gives each setting's default as agent/config.py declares it, and the
    guarantee with ``min_share = 0`` within the bounds ``HtbBackend.least`` computes (link/1000 at least A and at most
    B kbit/s: the bounds read at a slow and a fast link)."""
    from tensorlane.agent.config import _default
    from tensorlane.agent.kernel.qdisc import HtbBackend

    rows = _table(REPO / "docs" / "agent.md", "| setting | default | guarantees | to which classes |")
    assert {"min_share", "min_rate", "job_share", "min_share = 0"} <= set(rows), sorted(rows)
    for key in ("min_share", "min_rate", "job_share"):
        code = _default(key)
        assert code == _documented_default(key, rows[key][0]), f"{key}: docs say {rows[key][0]}, the code {code!r}"
    m = re.search(r"link/1000, at least (\d+) and at most (\d+) kbit/s", rows["min_share = 0"][1])
    assert m, rows["min_share = 0"]
    low, high = (HtbBackend(4, rate, min_share=0.0).least() // 1000 for rate in (1_000_000, 400_000_000_000))
    assert (int(m.group(1)), int(m.group(2))) == (low, high), f"docs say {m.groups()}, the code {low}-{high} kbit/s"
    assert HtbBackend(4, 100_000, min_share=0.01).least() // 1000 == low  # min_share's floor, "at least 8 kbit/s"
    assert f"at least {low} kbit/s" in rows["min_share"][1]


def test_the_job_policies_have_one_table_with_every_policy():
    """docs/jobs.md's "The policies" table, the one description of the job policies, has a row for every policy of
    ``policies.jobs.JOB_POLICIES`` and no other, and docs/agent.md has no second table of them (two drift)."""
    from tensorlane.policies.jobs import JOB_POLICIES

    rows = _table(REPO / "docs" / "jobs.md", "| `job_policy` | order of the jobs seen on this host | source |")
    assert set(rows) == set(JOB_POLICIES), sorted(set(rows) ^ set(JOB_POLICIES))
    agent_md = "\n".join(_prose((REPO / "docs" / "agent.md").read_text()))
    assert not re.search(r"^\| `job_policy` \| order", agent_md, re.M), "docs/agent.md has a table of the job policies"


def _code_value(path: Path, name: str):
    """The literal ``name`` is given in ``path``: a module's or class's ``NAME = value`` (a .py file), the default of a
    parameter ``name`` (every function of the file that has one: they must agree), or ``name: value`` of a YAML file."""
    import ast

    text = path.read_text()
    if path.suffix == ".yml":
        return float(re.search(rf"^{name}:\s*([\d.]+)\s*$", text, re.M).group(1))
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found.add(ast.literal_eval(node.value))
        elif isinstance(node, ast.FunctionDef):
            a = node.args
            pairs = list(zip(a.args[len(a.args) - len(a.defaults):], a.defaults, strict=True))
            pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
            found |= {ast.literal_eval(d) for arg, d in pairs if arg.arg == name and isinstance(d, ast.Constant)
                      and d.value is not None}
    assert len(found) == 1, f"{path.relative_to(REPO)}: {name} has the values {found or 'none'}"
    return found.pop()


def test_the_timings_table_is_the_codes():
    """docs/agent.md's "Timings" table gives each time as the file it names sets it: a setting's default
    (agent/config.py), a constant, a parameter's default, an Ansible default; the stall bound as health.py has it."""
    from tensorlane.agent.config import _default

    rows = {}
    for line in _prose((REPO / "docs" / "agent.md").read_text()):
        if line.startswith("| timing | value | set in |"):
            rows = {}
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and (m := re.fullmatch(r"`([\w/.]+\.(?:py|yml))` `(\w+)`", cells[2])):
            rows[cells[0]] = (float(re.match(r"[\d.]+", cells[1]).group()), m.group(1), m.group(2), cells[3])
    assert len(rows) >= 20, sorted(rows)
    wrong = []
    for timing, (value, path, name, what) in rows.items():
        if name == "stall_after_s":  # max(A, B * reconcile_interval_s)
            src = (REPO / path).read_text()
            low, times = re.search(r"max\(([\d.]+), (\d+) \* float\(api\.cfg\.reconcile_interval_s\)\)", src).groups()
            code, said = float(low), re.search(r"(\d+) x `reconcile_interval_s`, at least ([\d.]+) s", what).groups()
            if (int(said[0]), float(said[1])) != (int(times), float(low)):
                wrong.append(f"{timing}: docs say {said}, the code {times} x, at least {low}")
        else:
            code = _default(name) if path == "agent/config.py" else _code_value(REPO / path, name)
        if float(code) != value:
            wrong.append(f"{timing}: docs say {value}, {path} {name} = {code}")
    assert not wrong, wrong


def test_the_stats_table_is_what_stats_returns():
    """docs/shim.md's ``stats()`` table names every key ``Handle.stats()`` returns and no other, the nested keys of
    ``overlap``, ``levels`` and ``agent``, and says "yes" in its last column exactly for the keys a ``comm_state()``
    (``ShimState.summary``, no overlap) has (read from the source: importing the shim needs torch)."""
    import ast

    tree = ast.parse((REPO / "shim" / "ddp.py").read_text())
    funcs = {f"{c.name}.{f.name}": f for c in tree.body if isinstance(c, ast.ClassDef)
             for f in c.body if isinstance(f, ast.FunctionDef)}

    def keys(node) -> set[str]:
        return {k.value for k in node.keys if isinstance(k, ast.Constant)}

    summary = funcs["ShimState.summary"]
    main = next(n.value for n in ast.walk(summary) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "out" for t in n.targets))
    added = {n.targets[0].slice.value: n.value for f in (summary, funcs["Handle.stats"]) for n in ast.walk(f)
             if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Subscript)}
    shim_state = keys(main)
    handle = shim_state | set(added)
    rows = _table(REPO / "docs" / "shim.md", "| key | value | in `comm_state().stats()` |")
    assert set(rows) == handle, f"docs only: {sorted(set(rows) - handle)}, code only: {sorted(handle - set(rows))}"
    said_yes = {k for k, (_value, in_state) in rows.items() if in_state.startswith("yes")}
    assert said_yes == shim_state, sorted(said_yes ^ shim_state)
    nested = {"overlap": keys(added["overlap"]),
              "agent": {"connected", "last_error"} | set(re.findall(r'self\.counters\["(\w+)"\]',
                                                                  (REPO / "shim" / "agent_link.py").read_text())),
              "levels": {"level"} | {n.target.id for c in tree.body if isinstance(c, ast.ClassDef)
                                     and c.name == "LevelStats" for n in c.body if isinstance(n, ast.AnnAssign)}}
    for key, names in nested.items():
        said = set(re.findall(r"`(\w+)`", rows[key][0]))
        assert names <= said, f"stats()[{key!r}]: the table lacks {sorted(names - said)}"


def test_the_dscp_table_is_dscp_table():
    """docs/policies.md's table of the levels' default marks is ``dscp_table``'s: for each level its DSCP's name and
    value, ``switch_queue`` of it, and the level's HTB class (``HtbBackend.classid``); a row for every level up to
    ``MAX_LEVELS``."""
    from tensorlane.agent.kernel.qdisc import HtbBackend, fmt_handle
    from tensorlane.policies.levels import DSCP_NAMES, MAX_LEVELS, dscp_table, switch_queue

    rows = {}
    inside = False
    for line in _prose((REPO / "docs" / "policies.md").read_text()):
        if line.startswith("| level | DSCP | value | switch queue |"):
            inside = True
        elif inside and line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if m := re.match(r"(\d+)\b", cells[0]):
                rows[int(m.group(1))] = cells[1:]
        else:
            inside = False
    table = dscp_table(MAX_LEVELS)
    assert sorted(rows) == list(range(MAX_LEVELS)), sorted(rows)
    for level, (name, value, queue, host) in rows.items():
        dscp = table[level]
        want = (dscp, switch_queue(dscp), f"`{fmt_handle(HtbBackend(MAX_LEVELS, 10**9).classid(level))}`")
        assert DSCP_NAMES.get(name) == dscp and (int(value), int(queue), host) == want, \
            f"level {level}: docs say {name} {value} queue {queue} {host}, the code {dscp} queue {want[1]} {want[2]}"


# Settings whose bounds depend on another setting (the doc states them as expressions) or that are not plain numbers
RANGE_EXEMPT = {"min_share": "0..0.5 / (levels + 1)", "job_share": "0..min(0.95, 1 - min_share * (levels + 1))",
                "reserved_connections": "0..max_connections - 1",
                "max_connections_per_user": "1..max_connections - reserved_connections",
                "min_rate": "a rate, or 0", "socket_mode": "an octal mode"}
RANGE_NEEDS = {"rotate_epoch_s": {"job_policy": "rotate"}, "job_sample_s": {"job_policy": "shortest"},
               "job_hold_s": {"job_policy": "shortest"},
               "max_connections": {"reserved_connections": 0, "max_connections_per_user": 1}}


def test_every_numeric_setting_documents_its_range_and_the_agent_holds_it():
    """Each number setting of docs/agent.md's tables gives its range, ``(LO..HI)``, and it is the agent's: LO and HI
    are accepted, a step beyond either is refused (an integer setting by 1). Until 2026-11-28 seven settings gave
    none (``queue_limit_packets`` refuses below 10, ``reconcile_interval_s`` below 0.1 s): a value out of range was
    found only when the agent or the role's ``--check-config`` refused it."""
    from tensorlane.agent.config import _KEYS, ConfigError, _default, from_dict

    rows = _table(REPO / "docs" / "agent.md", "| field | default | meaning |")
    numeric = {k for k in _KEYS if type(_default(k)) in (int, float)} - set(RANGE_EXEMPT)
    assert {"queue_limit_packets", "reconcile_interval_s", "max_flows", "idle_timeout_s"} <= numeric
    missing = {}
    for key in sorted(numeric):
        found = re.findall(r"\((-?[\d.]+)\.\.(-?[\d.]+)\)", rows[key][1])
        if len(found) != 1:
            missing[key] = rows[key][1][:80]
            continue
        lo, hi = (float(x) for x in found[0])
        integer = isinstance(_default(key), int)
        step = 1 if integer else 1e-3 * max(1.0, abs(lo), abs(hi))
        cast = int if integer else float

        def accepts(value, key=key):
            try:
                from_dict({"interface": "eth0", **RANGE_NEEDS.get(key, {}), key: value})
            except ConfigError as exc:
                assert exc.field == key, exc
                return False
            return True

        assert accepts(cast(lo)) and accepts(cast(hi)), f"{key}: docs say ({found[0][0]}..{found[0][1]})"
        assert not accepts(cast(lo - step)), f"{key}: {lo - step} accepted, docs say from {found[0][0]}"
        assert not accepts(cast(hi + step)), f"{key}: {hi + step} accepted, docs say up to {found[0][1]}"
    assert not missing, f"no range (LO..HI) in docs/agent.md: {missing}"


def test_the_rate_settings_document_their_range_and_the_agent_holds_it():
    """``link_rate`` and ``min_rate`` (a rate string or bits/s) give their range in docs/agent.md, ``(LO..HI)`` in
    tc's units, and it is the agent's: LO and HI accepted, a bit/s beyond either refused (``min_rate`` also takes 0,
    off). Until 2026-11-28 neither gave one."""
    from tensorlane import units
    from tensorlane.agent.config import ConfigError, from_dict

    rows = _table(REPO / "docs" / "agent.md", "| field | default | meaning |")
    for key in ("link_rate", "min_rate"):
        found = re.findall(r"\((\d+[kmgt]?bit)\.\.(\d+[kmgt]?bit)\)", rows[key][1])
        assert len(found) == 1, f"{key}: no range (LO..HI) in docs/agent.md"
        lo, hi = (units.parse_rate(x, 1, 10**15) for x in found[0])
        for value, ok in ((lo, True), (hi, True), (lo - 1, False), (hi + 1, False)):
            try:
                from_dict({"interface": "eth0", key: value})
                accepted = True
            except ConfigError as exc:
                assert exc.field == key, exc
                accepted = False
            assert accepted == ok, f"{key} = {value} bit/s: docs say {found[0][0]}..{found[0][1]}"


def test_the_runbook_says_where_the_role_puts_the_commands_it_runs():
    """docs/runbook.md's commands (`tensorlane status`, `tensorlane-agentctl start`, `systemctl ... UNIT`) run on a
    host the Ansible role deployed, where the role puts `tensorlane` in its virtualenv and `tensorlane-agentctl` in
    its install directory, neither on PATH: the runbook's introduction names both paths, the unit and the socket as
    the role's defaults make them (until 2026-11-29 it named no path for `tensorlane`, and `tensorlane status` copied
    from it answered `command not found`)."""
    import yaml

    from tensorlane.client import DEFAULT_SOCKET

    defaults = yaml.safe_load((REPO / "ansible" / "roles" / "tensorlane" / "defaults" / "main.yml").read_text())

    def value(name: str) -> str:  # a default, its {{ tensorlane_* }} references expanded
        return re.sub(r"\{\{\s*(tensorlane_\w+)\s*\}\}", lambda m: value(m.group(1)), str(defaults[name]))

    intro = (REPO / "docs" / "runbook.md").read_text().split("\n## ", 1)[0]
    expected = {"tensorlane": value("tensorlane_venv") + "/bin/tensorlane", "agentctl": value("tensorlane_ctl"),
                "unit": value("tensorlane_service_name"), "socket": value("tensorlane_socket")}
    assert expected["socket"] == DEFAULT_SOCKET, expected
    missing = {k: v for k, v in expected.items() if f"`{v}`" not in intro}
    assert not missing, f"docs/runbook.md's introduction does not name: {missing}"
    assert "`tensorlane status`" in intro and "tensorlane-agentctl" in intro
