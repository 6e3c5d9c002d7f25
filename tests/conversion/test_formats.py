"""The registry of formats (`conversion/formats/__init__.py`) is the one source of what the command line and the
messages say: every format is listed wherever formats are listed, and an export option is one `ExportOption` in its
format, which the command line then offers (`--NAME`, with its help) and `convert` passes on, from both faces."""

import dataclasses

import pytest

from gated_qwen.cli import build_parser, main
from gated_qwen.conversion import ConversionError, convert
from gated_qwen.conversion.errors import CheckpointFormatError
from gated_qwen.conversion.format_types import ExportOption
from gated_qwen.conversion.formats import FORMATS, FROM_FORMATS, TO_FORMATS, format_of
from tests.helpers import assert_nothing_written, assert_refused


def convert_help() -> str:
    parser = build_parser()
    (subparsers,) = [action for action in parser._actions if action.choices and "convert" in action.choices]
    return " ".join(subparsers.choices["convert"].format_help().split())


def test_every_format_is_listed_wherever_formats_are_listed():
    """The command's help names every format with its summary and every direction's choices; a folder of no format
    is refused with every format it could have been."""
    text = convert_help()
    for name, fmt in FORMATS.items():
        assert f"{name} ({' '.join(fmt.summary.split())})" in text, name
    assert f"--from FORMAT import SRC in FORMAT ({', '.join(FROM_FORMATS)})" in text
    assert f"({', '.join(TO_FORMATS)})" in text
    with pytest.raises(CheckpointFormatError) as refusal:
        format_of({"model_type": "llama"})
    for name in FROM_FORMATS:
        assert f"{name} (" in str(refusal.value), name


def with_an_option(monkeypatch, option: ExportOption) -> list[dict]:
    """`--to qwen3_5` with `option` added to its export options (one edit: the Format's writing), its export recording the
    options it is given; returns that record."""
    received = []
    fmt = FORMATS["qwen3_5"]

    def export(checkpoint, **options):
        received.append(options)
        return fmt.writing.plan(checkpoint, **{k: v for k, v in options.items() if k != option.name})

    monkeypatch.setitem(FORMATS, "qwen3_5", dataclasses.replace(fmt, writing=dataclasses.replace(
        fmt.writing, plan=export, options=(*fmt.writing.options, option))))
    return received


def test_an_export_option_is_one_edit_of_its_format(monkeypatch, gated_source, tmp_path, capsys):
    received = with_an_option(monkeypatch, ExportOption("keep_notes", "keep the notes (a test's option)"))
    assert "--keep-notes with --to qwen3_5: keep the notes (a test's option)" in convert_help()
    assert main(["convert", str(gated_source), str(tmp_path / "a"), "--to", "qwen3_5", "--keep-notes"]) == 0
    assert received[-1] == {"keep_notes": True}
    convert(gated_source, tmp_path / "b", to_format="qwen3_5", keep_notes=True)
    assert received[-1] == {"keep_notes": True}
    convert(gated_source, tmp_path / "c", to_format="qwen3_5")  # not given: not passed
    assert received[-1] == {}
    assert_refused(capsys, ["convert", str(gated_source), str(tmp_path / "d"), "--to", "release", "--keep-notes"],
                "--keep-notes applies to --to qwen3_5 only", tmp_path / "d")
    with pytest.raises(ConversionError, match="convert\\(\\) has no option 'keep_note'; the export options are"):
        convert(gated_source, tmp_path / "e", to_format="qwen3_5", keep_note=True)
    assert_nothing_written(tmp_path / "e")


def test_an_export_option_with_a_value_is_read_with_its_type(monkeypatch, gated_source, tmp_path, capsys):
    received = with_an_option(monkeypatch, ExportOption("group_size", "a number (a test's option)", "N", int))
    assert main(["convert", str(gated_source), str(tmp_path / "a"), "--to", "qwen3_5", "--group-size", "64"]) == 0
    assert received[-1] == {"group_size": 64}
    with pytest.raises(SystemExit) as refused:  # the parser's refusal: one line, exit status 2
        main(["convert", str(gated_source), str(tmp_path / "b"), "--to", "qwen3_5", "--group-size", "x"])
    assert refused.value.code == 2
    assert "gated-qwen: error: argument --group-size: invalid int value: 'x'" in capsys.readouterr().err
    assert_nothing_written(tmp_path / "b")
