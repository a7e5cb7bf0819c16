"""Theme files: built-ins load with heat colours; bad files are reported, never fatal."""

from __future__ import annotations

import pytest

from esamp_tui.theming import HEAT_VARIABLES, REPO_THEMES, heat_ramp, load_themes, parse_theme_text


def test_builtin_themes_load_with_heat_variables(tmp_path):
    themes, problems = load_themes(tmp_path)
    assert problems == []
    by_name = {t.name: t for t in themes}
    assert {"dark", "light", "high-contrast"} <= set(by_name)
    assert by_name["light"].dark is False
    for theme in by_name.values():
        assert all(v in theme.variables for v in HEAT_VARIABLES + ["heat-plain"])


def test_every_repo_theme_file_is_valid():
    files = sorted(REPO_THEMES.glob("*.toml"))
    assert len(files) >= 3
    for path in files:
        parse_theme_text(path.read_text())


@pytest.mark.parametrize(
    "text, reason",
    [
        ("name = 'x'\n[colors\n", "not valid TOML"),
        ("name = 'x'\n[colors]\nprimary = '#fff'\n", "heat: Field required"),
        ("name = 'x'\n[colors]\nprimary = 'nope'\n[heat]\nstops=['#000']*5\n", "'nope' is not a colour"),
        ("name = 'x'\n[colors]\nprimary = '#fff'\n[heat]\nstops=['#000', '#111']\n", "heat.stops"),
        ("name = 'x y'\n[colors]\nprimary = '#fff'\n[heat]\nstops=['#000','#111','#222','#333','#444']\n", "name"),
        (
            "name = 'x'\nfont = 1\n[colors]\nprimary = '#fff'\n[heat]\nstops=['#000','#111','#222','#333','#444']\n",
            "font",
        ),
    ],
)
def test_bad_theme_text_says_why(text, reason):
    with pytest.raises(ValueError) as info:
        parse_theme_text(text.replace("['#000']*5", "['#000','#000','#000','#000','#000']"))
    assert reason in str(info.value)


def test_user_folder_overrides_and_reports(tmp_path):
    (tmp_path / "dark.toml").write_text(
        "name = 'dark'\n[colors]\nprimary = '#010203'\n[heat]\nstops=['#000','#111','#222','#333','#444']\n"
    )
    (tmp_path / "bad.toml").write_bytes(b"\xff\xfe not utf8")
    themes, problems = load_themes(tmp_path)
    assert {t.name: t for t in themes}["dark"].primary == "#010203"
    assert len(problems) == 1 and "bad.toml" in problems[0].text()


def test_heat_ramp_runs_from_first_to_last_stop():
    variables = {f"heat-{i}": c for i, c in enumerate(["#000000", "#404040", "#808080", "#c0c0c0", "#ffffff"])}
    ramp = heat_ramp(variables, 9)
    assert ramp[0].hex == "#000000" and ramp[-1].hex == "#FFFFFF" and ramp[4].hex == "#808080"
