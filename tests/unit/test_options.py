"""The options are defined once (cell/options.py's OPTIONS): the usage line, %taas help and the session's settings are
made from it (the docs' reference too: tests/unit/test_docs_pages.py)."""


import pytest
from traitlets import TraitError

from taas_magic.cell.options import OPTIONS, PragmaError, usage
from taas_magic.cell.pragma import PragmaOptions, parse_options
from taas_magic.kernel.magic.commands import HELP
from taas_magic.kernel.magic.magics import TaasMagics


def test_help_and_usage_name_every_option_with_its_value():
    for option in OPTIONS:
        assert option.signature in HELP and option.help in HELP
        assert option.signature in usage()


def test_every_option_parses_and_sets_its_own_field():
    samples = {"--gpus": "2", "--device": "cpu", "--cpus": "3", "--units": "9", "--cache-ram": "1G", "--ahead": "4", "--timeout": "5",
               "--hang": "0", "--restarts": "2", "--per-host": "1", "--place-timeout": "7", "--output": "all", "--detach": "", "--keep": "",
               "--trials": "8", "--parallel": "2", "--objective": "acc", "--maximize": "", "--sampler": "grid",
               "--prune": "halving", "--study": "s1", "--shared": "ckpt,out/zero", "--profile": "5"}
    assert set(samples) == {option.flag for option in OPTIONS}
    searching = {"--trials", "--parallel", "--objective", "--maximize", "--sampler", "--prune", "--study"}
    parsed = parse_options(" ".join(f"{flag} {value}" for flag, value in samples.items() if flag not in searching))
    assert (parsed.gpus, parsed.device, parsed.cpus, parsed.units, parsed.cache_ram, parsed.ahead, parsed.timeout, parsed.restarts,
            parsed.per_host, parsed.place_timeout, parsed.output, parsed.detach, parsed.shared, parsed.hang) == \
        (2, "cpu", 3, 9, 1 << 30, 4, 5.0, 2, 1, 7.0, "all", True, ("ckpt", "out/zero"), 0.0)
    search = parse_options("--gpus 2 " + " ".join(f"{flag} {samples[flag]}" for flag in sorted(searching)))
    assert (search.trials, search.parallel, search.objective, search.maximize, search.sampler, search.prune,
            search.study) == (8, 2, "acc", True, "grid", "halving", "s1")
    assert parse_options("--gpus 2").detach is False
    assert parsed.profile == 5 and parse_options("--gpus 2").profile == 0  # 0: not profiled
    assert parse_options("--gpus 2 --profile").profile == 3 == parse_options("--profile --gpus 2").profile  # N left out
    assert parse_options("--gpus 2 --profile=7").profile == 7
    with pytest.raises(PragmaError, match="--profile must be 1..1000, got '0'"):
        parse_options("--gpus 2 --profile 0")
    with pytest.raises(PragmaError, match="--profile with --trials"):
        parse_options("--gpus 2 --trials 2 --profile")
    assert parse_options("--gpus 2 --keep").keep is True and parse_options("--gpus 2").keep is None  # None: the session's
    with pytest.raises(PragmaError, match="--detach takes no value"):
        parse_options("--gpus 2 --detach=yes")
    with pytest.raises(PragmaError, match=r"--gpus N\|auto is required"):
        parse_options("--cpus 2")


@pytest.mark.parametrize(
    ("setting", "value", "accepted"),
    [
        ("warm", "bogus", "'off', 'auto' or a number"),
        ("cache_ram", "lots", "a size such as 512M or 4G"),
        ("timeout", -1.0, "a positive number of seconds"),
        ("place_timeout", 0.0, "a positive number of seconds"),
        ("hang", -1.0, r"a positive number of seconds, or 0 \(never\)"),
        ("ahead", 1, "at least 2"),
        ("restarts", 101, "0..100"),
        ("restarts", -1, "0..100"),
        ("max_output_lines", 0, "at least 1"),
    ],
)
def test_a_setting_with_an_invalid_value_is_refused_naming_what_is_accepted(setting, value, accepted):
    magics = TaasMagics(shell=None)
    try:
        with pytest.raises(TraitError, match=accepted):
            setattr(magics, setting, value)
    finally:
        magics.spares.close(wait=30)  # the factory it started at load, reaped (not left to the garbage collector)


SESSION = {"cache_ram": "2G", "ahead": 8, "timeout": 30.0, "hang": 45.0, "restarts": 1, "place_timeout": 5.0, "output": "all", "keep": False}


def test_a_runs_settings_are_the_pragmas_then_the_sessions_then_the_tables_defaults():
    from taas_magic.cell.pragma import settle

    assert set(SESSION) == {option.setting for option in OPTIONS if option.setting}
    given = settle(parse_options("--gpus auto --ahead 4 --output rank0 --cpus 2"), SESSION, ranks=3)
    assert (given.gpus, given.ahead, given.output, given.cpus) == (3, 4, "rank0", 2)  # the pragma's
    assert (given.cache_ram, given.timeout, given.restarts, given.place_timeout, given.hang) == (2 << 30, 30.0, 1, 5.0, 45.0)
    kept = dict(SESSION, keep=True)
    assert settle(parse_options("--gpus 2"), kept, ranks=2).keep is True  # the session's default
    assert settle(parse_options("--gpus 2 --trials 3"), kept, ranks=2).keep is False  # a search keeps no ranks
    automatic = dict(SESSION, cache_ram="", timeout=None)
    plain = settle(parse_options("--gpus 1"), automatic, ranks=1)
    assert (plain.cache_ram, plain.timeout, plain.device, plain.units, plain.per_host) == (None, None, "auto", None, None)


def test_every_session_default_is_a_setting_made_from_its_options_row():
    magics = TaasMagics(shell=None)
    try:
        for option in OPTIONS:
            if option.setting is None:  # no session setting: the pragma's own default is the table's
                assert option.required or getattr(PragmaOptions(gpus=1), option.field) == option.default, option.flag
                continue
            trait = magics.traits()[option.setting]
            assert trait.default_value == ("" if option.default is None and option.field == "cache_ram" else option.default)
            assert f"Default for {option.flag}" in trait.help
    finally:
        magics.spares.close(wait=30)  # the factory it started at load, reaped (not left to the garbage collector)


def test_status_shows_every_options_session_default_from_the_table():
    from taas_magic.cell.options import shown_defaults
    from taas_magic.kernel.magic.status import status_text

    defaults = shown_defaults(dict(SESSION, cache_ram=""))
    line = next(line for line in status_text(None, 0, defaults).splitlines() if line.startswith("defaults: "))
    assert line == ("defaults: --cache-ram auto, --ahead 8, --timeout 30.0, --hang 45.0, --restarts 1, --place-timeout 5.0, "
                    "--output all, --keep False")


@pytest.mark.parametrize(("text", "after_two_ranks"), [("off", 0), ("auto", 2), ("0", 0), ("5", 5)])
def test_warm_is_parsed_in_one_place(text, after_two_ranks):
    from taas_magic.kernel.runs.session import Warm

    assert Warm.parse(text).after(2) == after_two_ranks
    for bad in ("", "-1", "some", "2.5"):
        with pytest.raises(ValueError):
            Warm.parse(bad)
