"""Every data-parallel rank's ESamp counters as one Prometheus text (``GET /esamp/metrics``).

Each rank's side channel (``esamp.serving.channel``) answers its own counters, every sample
labelled ``rank``. Concatenating them would repeat each family's ``# HELP``/``# TYPE`` lines, which
the exposition format does not allow, so the texts are merged by family: one header, then every
rank's sample. Counters a rank has not moved yet are shown as 0 (a counter is exposed from its
start), and ``esamp_channel_up{rank}`` says which ranks answered (0: the numbers of that rank are
missing, not zero).
"""

from __future__ import annotations

from esamp.serving.channel import METRICS

UP = ("esamp_channel_up", "gauge", "1 when this rank's ESamp side channel answered, 0 when it did not")


def parse(text: str) -> dict[str, dict]:
    """family name → {"help", "type", "samples": [(labels text, value text)]}, in text order."""
    families: dict[str, dict] = {}

    def family(name: str) -> dict:
        return families.setdefault(name, {"help": None, "type": None, "samples": []})

    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                family(parts[2])[parts[1].lower()] = parts[3] if len(parts) > 3 else ""
            continue
        head, _, value = line.rpartition(" ")
        name, brace, labels = head.partition("{")
        family(name)["samples"].append(("{" + labels if brace else "", value))
    return families


def merge(texts: dict[int, str | None]) -> str:
    """One exposition text from each rank's (None: the rank did not answer)."""
    merged: dict[str, dict] = {}
    for name, kind, help_text in METRICS.values():
        merged[name] = {"help": help_text, "type": kind, "samples": []}
    for rank in sorted(texts):
        text = texts[rank]
        if text is None:
            continue
        got = parse(text)
        for name, fam in got.items():
            into = merged.setdefault(name, {"help": fam["help"], "type": fam["type"], "samples": []})
            into["samples"].extend(fam["samples"])
        for name, kind, _ in METRICS.values():
            if kind == "counter" and not got.get(name, {}).get("samples"):
                merged[name]["samples"].append((f'{{rank="{rank}"}}', "0"))
    merged[UP[0]] = {
        "help": UP[2],
        "type": UP[1],
        "samples": [(f'{{rank="{r}"}}', "0" if texts[r] is None else "1") for r in sorted(texts)],
    }
    lines = []
    for name, fam in merged.items():
        if not fam["samples"]:
            continue  # a gauge no rank has a value for yet (the loss before any training)
        if fam["help"] is not None:
            lines.append(f"# HELP {name} {fam['help']}")
        if fam["type"] is not None:
            lines.append(f"# TYPE {name} {fam['type']}")
        lines += [f"{name}{labels} {value}" for labels, value in fam["samples"]]
    return "\n".join(lines) + "\n"
