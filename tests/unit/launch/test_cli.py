"""The `tritonllm` command: the package's own commands and the benchmarks it finds as declared entry points."""

import inspect

from tritonllm import cli


def test_the_benchmarks_are_found_through_their_entry_points_and_load():
    plugins = cli.plugins()
    assert set(plugins) == {"perf", "bench", "bench-pipeline", "bench-peers", "bench-fleet"}
    for name, plugin in plugins.items():
        run = plugin.load()
        assert plugin.module.startswith("benchmarks.") and callable(run), name
        assert list(inspect.signature(run).parameters) == ["argv"], name


def test_every_command_is_listed_and_an_unknown_one_is_refused(capsys):
    assert cli.main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in [*cli.COMMANDS, *cli.plugins()])
    assert cli.main(["nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_a_command_gets_its_arguments(capsys):
    try:
        cli.main(["build", "--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert "--engine {portable,trtllm,trtllm-llmapi,synthetic}" in capsys.readouterr().out
