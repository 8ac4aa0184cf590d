"""Plugins: the register_tiers hook, entry-point discovery, and errors that name the plugin.

Hook tests are named ``test_hook_<hookname>...``; test_every_hookspec_is_tested checks that each
hook in ucm/hookspecs.py has one (the datasette convention).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pluggy
import pytest

import ucm
from ucm import hookspecs, plugins
from ucm.errors import ConfigError, PluginError
from ucm.stack import parse_stack

REPO = Path(__file__).resolve().parents[1]
STACK = {"unique_id": "plugin-test", "shard_size": 4096, "shards_per_block": 2}

RegisterPlugin = Callable[[object, str], None]


def hookspec_names() -> list[str]:
    return sorted(
        name for name, value in vars(hookspecs).items() if hasattr(value, "ucm_spec") is True
    )


def installed_types() -> str:
    return ", ".join(sorted(plugins.tier_types()))


@pytest.fixture
def fresh_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> pluggy.PluginManager:
    """A new, unloaded plugin manager, so that load_plugins() runs again inside the test."""
    manager = pluggy.PluginManager("ucm")
    manager.add_hookspecs(hookspecs)
    monkeypatch.setattr(plugins, "pm", manager)
    monkeypatch.setattr(plugins, "_loaded", False)
    return manager


@pytest.fixture
def fake_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str, str, str], None]]:
    """``fake_distribution(entry_point_name, module_name, module_source)`` installs a real,
    minimal distribution (dist-info + module) on sys.path that declares a ``ucm.backends``
    entry point, as ``pip install`` of a third-party plugin would."""
    modules: list[str] = []

    def install(entry_point: str, module: str, source: str) -> None:
        dist_info = tmp_path / f"{module}-0.1.dist-info"
        dist_info.mkdir()
        project = module.replace("_", "-")
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {project}\nVersion: 0.1\n"
        )
        (dist_info / "entry_points.txt").write_text(
            f"[{plugins.ENTRY_POINT_GROUP}]\n{entry_point} = {module}\n"
        )
        if source:
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        modules.append(module)

    monkeypatch.syspath_prepend(str(tmp_path))
    yield install
    for module in modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


# -- tiers registered through the hook by a plugin object (llm-style fixture) -------------------


def test_hook_register_tiers_from_a_registered_plugin(scratch_tier: type[ucm.Tier]) -> None:
    assert plugins.tier_types()["scratch"] is scratch_tier
    stack = parse_stack(STACK | {"tiers": [{"type": "scratch", "capacity": "1MiB"}]})
    tier = stack.tiers[0]
    assert type(tier) is scratch_tier.config_model
    assert tier.model_dump() == {
        "type": "scratch",
        "name": None,
        "write": "through",
        "promote": False,
        "codec": {"type": "none"},
        "lookup_timeout_ms": 1000,
        "breaker": {"failures": 3, "probe_interval_ms": 10000},
        "admit": "always",
        "capacity": 1024**2,
    }


def test_hook_register_tiers_unknown_type_lists_registered_plugin_types(
    scratch_tier: type[ucm.Tier],
) -> None:
    assert "scratch" in plugins.tier_types()
    with pytest.raises(ConfigError) as excinfo:
        parse_stack(STACK | {"tiers": [{"type": "scratchy"}]})
    assert excinfo.value.problems[0].startswith("tiers[0].type: unknown tier type ")
    assert f"; installed tier types: {installed_types()} (got " in excinfo.value.problems[0]
    assert ", scratch" in installed_types() or installed_types().startswith("scratch")


def test_registered_plugin_type_is_gone_after_the_fixture() -> None:
    # The scratch fixture unregisters its plugin at teardown; no other test leaks it.
    assert "scratch" not in plugins.tier_types()
    assert not plugins.pm.has_plugin("scratch-plugin")
    with pytest.raises(ConfigError) as excinfo:
        parse_stack(STACK | {"tiers": [{"type": "scratch"}]})
    assert f"installed tier types: {installed_types()} (got " in str(excinfo.value)


def test_hook_register_tiers_plugin_can_register_several_types(
    register_plugin: RegisterPlugin,
) -> None:
    first, second = _tier_class("alpha"), _tier_class("beta")

    class TwoTiers:
        @ucm.hookimpl
        def register_tiers(self, register: Callable[[type[ucm.Tier]], None]) -> None:
            register(first)
            register(second)
            register(first)  # the same class twice is harmless

    register_plugin(TwoTiers(), "two-tiers")
    types = plugins.tier_types()
    assert types["alpha"] is first
    assert types["beta"] is second
    stack = parse_stack(STACK | {"tiers": [{"type": "alpha"}, {"type": "beta", "write": "back"}]})
    assert [type(t) for t in stack.tiers] == [first.config_model, second.config_model]
    assert stack.tiers[1].model_dump()["write"] == "back"


def test_builtin_tiers_come_through_the_same_hook() -> None:
    types = plugins.tier_types()
    for module_name in plugins.DEFAULT_PLUGINS:
        module = importlib.import_module(module_name)
        assert plugins.pm.get_plugin(module_name) is module
        assert hasattr(module, "register_tiers")
    assert types["posix"].__module__ == "ucm_backends.posix"
    assert types["fsspec"].__module__ == "ucm_backends.fsspec_tier"


# -- the example package, found through its entry point -----------------------------------------


def _example_installed() -> bool:
    try:
        importlib.metadata.distribution("ucm-tier-sqlite")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_example = pytest.mark.skipif(
    not _example_installed(),
    reason="example plugin not installed: pip install -e examples/ucm-tier-sqlite",
)


@needs_example
def test_hook_register_tiers_example_package_found_through_its_entry_point() -> None:
    import ucm_tier_sqlite

    (entry_point,) = [
        ep
        for ep in importlib.metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)
        if ep.name == "sqlite"
    ]
    assert entry_point.value == "ucm_tier_sqlite"
    assert entry_point.dist is not None and entry_point.dist.name == "ucm-tier-sqlite"
    assert plugins.tier_types()["sqlite"] is ucm_tier_sqlite.SqliteTier
    assert plugins.pm.get_plugin("sqlite") is ucm_tier_sqlite
    stack = parse_stack(
        STACK | {"tiers": [{"type": "sqlite", "path": "/tmp/x.sqlite3", "capacity": "1GiB"}]}
    )
    assert isinstance(stack.tiers[0], ucm_tier_sqlite.SqliteTierConfig)
    assert stack.tiers[0].model_dump()["capacity"] == 1024**3


@needs_example
def test_example_package_misspelled_key_is_rejected_with_its_path() -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_stack(STACK | {"tiers": [{"type": "sqlite", "path": "/tmp/x", "capcity": 5}]})
    assert excinfo.value.problems == [
        "tiers[0].capcity: unknown key (misspelled?); not allowed here (got 5)"
    ]


# -- plugins that fail: a clear PluginError naming the plugin ------------------------------------


def test_entry_point_that_fails_to_import_names_the_plugin(
    fresh_plugin_manager: pluggy.PluginManager,
    fake_distribution: Callable[[str, str, str], None],
) -> None:
    fake_distribution("broken", "ucm_broken_tier_plugin", "")  # declares a module it lacks
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value) == (
        "plugin 'broken' (ucm_broken_tier_plugin, from ucm-broken-tier-plugin) failed to load: "
        "ModuleNotFoundError: No module named 'ucm_broken_tier_plugin'"
    )
    assert not fresh_plugin_manager.has_plugin("broken")


def test_entry_point_whose_module_raises_names_the_plugin_and_the_cause(
    fresh_plugin_manager: pluggy.PluginManager,
    fake_distribution: Callable[[str, str, str], None],
) -> None:
    fake_distribution(
        "exploding", "ucm_exploding_tier", "raise RuntimeError('libfoo.so.3 not found')\n"
    )
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value) == (
        "plugin 'exploding' (ucm_exploding_tier, from ucm-exploding-tier) failed to load: "
        "RuntimeError: libfoo.so.3 not found"
    )
    assert isinstance(excinfo.value.__cause__, RuntimeError)


_GOOD_PLUGIN_SOURCE = """
from typing import Literal

import ucm


class GoodConfig(ucm.LowerTierConfig):
    type: Literal["goodtier"]
    depth: int = 1


class GoodTier(ucm.Tier):
    type_name = "goodtier"
    config_model = GoodConfig

    def lookup(self, keys):
        return [False] * len(keys)

    def load(self, keys, destinations):
        return [ucm.KeyMissingError("empty") for _ in keys]

    def dump(self, keys, sources):
        return [ucm.TierError("read-only") for _ in keys]

    def touch(self, block_ids):
        pass

    def batched_remove(self, keys, force=False):
        return 0


@ucm.hookimpl
def register_tiers(register):
    register(GoodTier)
"""


def test_entry_point_plugin_that_loads_is_registered_under_its_entry_point_name(
    fresh_plugin_manager: pluggy.PluginManager,
    fake_distribution: Callable[[str, str, str], None],
) -> None:
    fake_distribution("goodtier", "ucm_good_tier", _GOOD_PLUGIN_SOURCE)
    types = plugins.tier_types()
    module = sys.modules["ucm_good_tier"]
    assert fresh_plugin_manager.get_plugin("goodtier") is module
    assert types["goodtier"] is module.GoodTier
    stack = parse_stack(STACK | {"tiers": [{"type": "goodtier", "depth": 3}]})
    assert stack.tiers[0].model_dump()["depth"] == 3


def test_builtin_plugin_that_fails_to_import_names_it(
    fresh_plugin_manager: pluggy.PluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        plugins, "DEFAULT_PLUGINS", (*plugins.DEFAULT_PLUGINS, "ucm_backends.no_such_tier")
    )
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value) == (
        "built-in plugin 'ucm_backends.no_such_tier' failed to import: "
        "No module named 'ucm_backends.no_such_tier'"
    )


def test_a_failed_plugin_load_is_reported_again_not_skipped_silently(
    fresh_plugin_manager: pluggy.PluginManager,
    fake_distribution: Callable[[str, str, str], None],
) -> None:
    fake_distribution("broken", "ucm_broken_again", "")
    for _ in range(2):
        with pytest.raises(PluginError, match=r"^plugin 'broken' "):
            plugins.tier_types()


def test_entry_point_with_a_bad_hook_signature_is_a_plugin_error(
    fresh_plugin_manager: pluggy.PluginManager,
    fake_distribution: Callable[[str, str, str], None],
) -> None:
    fake_distribution(
        "badsig",
        "ucm_badsig_tier",
        "import ucm\n\n@ucm.hookimpl\ndef register_tiers(registry):\n    pass\n",
    )
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value).startswith(
        "plugin 'badsig' (ucm_badsig_tier, from ucm-badsig-tier) is invalid: "
        "Plugin 'badsig' for hook 'register_tiers'"
    )
    assert "{'registry'}" in str(excinfo.value)


def test_entry_point_with_a_misspelled_hook_is_a_plugin_error(
    fresh_plugin_manager: pluggy.PluginManager,
    fake_distribution: Callable[[str, str, str], None],
) -> None:
    fake_distribution(
        "typo",
        "ucm_typo_tier",
        "import ucm\n\n@ucm.hookimpl\ndef register_tier(register):\n    pass\n",
    )
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value).startswith(
        "plugin 'typo' (ucm_typo_tier, from ucm-typo-tier) is invalid: "
        "unknown hook 'register_tier' in plugin <module 'ucm_typo_tier' from "
    )
    assert not fresh_plugin_manager.has_plugin("typo")


def test_hook_register_tiers_raising_names_the_plugin(register_plugin: RegisterPlugin) -> None:
    class Exploding:
        @ucm.hookimpl
        def register_tiers(self, register: Callable[[type[ucm.Tier]], None]) -> None:
            raise RuntimeError("no GPU driver")

    register_plugin(Exploding(), "exploding-plugin")
    message = "plugin 'exploding-plugin' failed in register_tiers: RuntimeError: no GPU driver"
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value) == message
    # Validating a stack surfaces the same error, not a confusing "unknown tier type".
    with pytest.raises(PluginError) as excinfo:
        parse_stack(STACK | {"tiers": [{"type": "posix", "path": "/tmp/x"}]})
    assert str(excinfo.value) == message


@pytest.mark.parametrize(
    ("registered", "message"),
    [
        (dict, "plugin 'bad-plugin' registered <class 'dict'>, which is not a ucm.Tier"),
        ("posix", "plugin 'bad-plugin' registered 'posix', which is not a ucm.Tier"),
    ],
)
def test_hook_register_tiers_of_a_non_tier_is_rejected(
    register_plugin: RegisterPlugin, registered: object, message: str
) -> None:
    register_plugin(_plugin_registering(registered), "bad-plugin")
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value) == message


def test_hook_register_tiers_with_a_wrong_type_literal_is_rejected(
    register_plugin: RegisterPlugin,
) -> None:
    tier = _tier_class("alpha", literal="beta")
    register_plugin(_plugin_registering(tier), "bad-plugin")
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value) == (
        "plugin 'bad-plugin': AlphaConfig.type must be Literal['alpha'], got typing.Literal['beta']"
    )


def test_hook_register_tiers_with_a_plain_str_type_is_rejected(
    register_plugin: RegisterPlugin,
) -> None:
    class LooseConfig(ucm.LowerTierConfig):
        pass  # inherits `type: str`: would accept any type name

    tier = _tier_class("loose", config=LooseConfig)
    register_plugin(_plugin_registering(tier), "bad-plugin")
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value) == (
        "plugin 'bad-plugin': LooseConfig.type must be Literal['loose'], got <class 'str'>"
    )


def test_hook_register_tiers_with_a_config_model_that_is_not_a_tier_config_is_rejected(
    register_plugin: RegisterPlugin,
) -> None:
    tier = _tier_class("alpha", config=dict)
    register_plugin(_plugin_registering(tier), "bad-plugin")
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value) == (
        "plugin 'bad-plugin': AlphaTier.config_model must subclass ucm.TierConfig"
    )


def test_hook_register_tiers_without_a_type_name_is_rejected(
    register_plugin: RegisterPlugin,
) -> None:
    tier = _tier_class("alpha")
    tier.type_name = ""
    register_plugin(_plugin_registering(tier), "bad-plugin")
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value) == "plugin 'bad-plugin': AlphaTier.type_name must be a str"


def test_hook_register_tiers_duplicate_type_name_is_rejected(
    register_plugin: RegisterPlugin,
) -> None:
    register_plugin(_plugin_registering(_tier_class("twin")), "first-plugin")
    register_plugin(_plugin_registering(_tier_class("twin")), "second-plugin")
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    # Which of the two plugins is seen first depends on pluggy's iteration order.
    assert str(excinfo.value) in {
        f"plugin '{name}' registers tier type 'twin', which {__name__} already registered"
        for name in ("first-plugin", "second-plugin")
    }


def test_hook_register_tiers_cannot_take_over_a_builtin_type(
    register_plugin: RegisterPlugin,
) -> None:
    register_plugin(_plugin_registering(_tier_class("posix")), "impostor")
    with pytest.raises(PluginError) as excinfo:
        plugins.tier_types()
    assert str(excinfo.value) in {
        "plugin 'impostor' registers tier type 'posix', which ucm_backends.posix already "
        "registered",
        f"plugin 'ucm_backends.posix' registers tier type 'posix', which {__name__} already "
        "registered",
    }


def test_hook_register_tiers_with_a_wrong_signature_is_rejected_at_registration(
    register_plugin: RegisterPlugin,
) -> None:
    class WrongArgument:
        @ucm.hookimpl
        def register_tiers(self, registry: object) -> None:
            pass

    with pytest.raises(pluggy.PluginValidationError, match="'registry'"):
        register_plugin(WrongArgument(), "wrong-argument")


# -- the meta-test ----------------------------------------------------------------------------


def test_hookspecs_are_found() -> None:
    assert hookspec_names() == ["register_tiers"]


@pytest.mark.parametrize("hook", hookspec_names())
def test_every_hookspec_is_documented(hook: str) -> None:
    guide = (REPO / "docs" / "plugins.md").read_text()
    assert re.search(rf"^#+ `?{hook}\(", guide, flags=re.MULTILINE), (
        f"docs/plugins.md needs a heading for the hook {hook}(...)"
    )


@pytest.mark.parametrize("hook", hookspec_names())
def test_every_hookspec_is_tested(hook: str) -> None:
    tests = [name for name in globals() if name.startswith(f"test_hook_{hook}")]
    assert tests, f"tests/test_plugins.py needs a test named test_hook_{hook}..."


# -- helpers ------------------------------------------------------------------------------------


def _tier_class(type_name: str, literal: str | None = None, config: Any = None) -> type[ucm.Tier]:
    """A complete (if empty) tier class whose config model's ``type`` is ``Literal[literal]``."""
    if config is None:
        config = type(
            f"{type_name.title()}Config",
            (ucm.LowerTierConfig,),
            {"__annotations__": {"type": Literal[literal or type_name]}, "__module__": __name__},
        )

    class _Tier(ucm.Tier):
        config_model = config

        def lookup(self, keys: Any) -> list[bool]:
            return [False] * len(keys)

        def load(self, keys: Any, destinations: Any) -> list[Any]:
            return [ucm.KeyMissingError("empty") for _ in keys]

        def dump(self, keys: Any, sources: Any) -> list[Any]:
            return [ucm.TierError("read-only") for _ in keys]

        def touch(self, block_ids: Any) -> None:
            pass

        def batched_remove(self, keys: Any, force: bool = False) -> int:
            return 0

    _Tier.type_name = type_name
    _Tier.__name__ = _Tier.__qualname__ = f"{type_name.title()}Tier"
    return _Tier


def _plugin_registering(item: object) -> object:
    class OnePlugin:
        @ucm.hookimpl
        def register_tiers(self, register: Callable[[Any], None]) -> None:
            register(item)

    return OnePlugin()
