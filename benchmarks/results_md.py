"""The one writer of benchmarks/RESULTS.md: each benchmark owns the section between its markers.

`write_section("sim_speed", body)` replaces what stands between `<!-- sim_speed:begin -->` and
`<!-- sim_speed:end -->`, or appends the section when the file has none yet; every other section
stays as it is.
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEADER = "# Benchmark results\n"


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    section = f"{begin}\n{body.strip(chr(10))}\n{end}"
    text = path.read_text() if path.exists() else HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
