"""node/uv_env.py: pip's settings passed on to uv, and only what the layers lack installed."""

import os

from node import uv_env


def test_pip_settings_come_from_its_files_in_order_then_from_pip_variables(tmp_path):
    home = tmp_path / "home"
    (home / ".config" / "pip").mkdir(parents=True)
    (home / ".config" / "pip" / "pip.conf").write_text("[global]\nindex-url = https://user.example/simple\n")
    xdg = tmp_path / "xdg"
    (xdg / "pip").mkdir(parents=True)
    (xdg / "pip" / "pip.conf").write_text(
        "[global]\nindex-url = https://site.example/simple\nconstraint = /etc/c.txt\n"
        "[install]\nfind-links =\n    /opt/a\n    /opt/b\n"
    )
    environ = {"XDG_CONFIG_DIRS": str(xdg), "PIP_DEFAULT_TIMEOUT": "180", "PIP_NO_INDEX": "1"}
    settings = uv_env.pip_settings(environ, str(home))
    assert settings["index-url"] == "https://user.example/simple"  # the user's file over the site's
    assert settings["constraint"] == "/etc/c.txt" and settings["find-links"] == "/opt/a /opt/b"
    assert settings["default-timeout"] == "180" and settings["no-index"] == "1"
    assert uv_env.pip_settings({**environ, "PIP_CONFIG_FILE": os.devnull}, str(home)) == {
        "default-timeout": "180",
        "no-index": "1",
    }


def test_uv_gets_pips_registries_its_choice_among_indexes_and_a_node_local_cache():
    settings = {
        "index-url": "https://i.example/simple",
        "extra-index-url": "file:///opt/one file:///opt/two",
        "find-links": "/opt/a /opt/b",
        "cert": "/etc/ca.crt",
        "no-index": "true",
        "disable-pip-version-check": "1",
    }
    environ = uv_env.uv_environment(settings, "/home/u/.gpu-cluster/uv-cache", {"UV_INDEX_URL": "https://mine"})
    assert environ["UV_INDEX_URL"] == "https://mine"  # uv's own setting stays
    assert environ["UV_EXTRA_INDEX_URL"] == "file:///opt/one file:///opt/two"
    assert environ["UV_FIND_LINKS"] == "/opt/a,/opt/b" and environ["SSL_CERT_FILE"] == "/etc/ca.crt"
    assert environ["UV_NO_INDEX"] == "1" and environ["UV_INDEX_STRATEGY"] == "unsafe-best-match"
    assert environ["UV_CACHE_DIR"] == "/home/u/.gpu-cluster/uv-cache"
    assert not any(value == "1" and key.startswith("UV_DISABLE") for key, value in environ.items())


def test_only_what_the_layers_lack_is_installed_behind_the_index_options():
    compiled = (
        "--index-url https://pypi.org/simple\n--find-links wheels\n\n"
        "numpy==2.4.6\ntorch==2.13.0+cpu\nTyping_Extensions==4.15.0\nrich==15.0.0 ; python_version >= '3.9'\n"
    )
    have = {"torch": "2.13.0+cpu", "typing-extensions": "4.15.0", "rich": "14.0.0"}
    assert uv_env.pinned_lines(compiled, have) == [
        "--index-url https://pypi.org/simple",
        "--find-links wheels",
        "numpy==2.4.6",
        "rich==15.0.0 ; python_version >= '3.9'",
    ]
    assert uv_env.pinned_lines("--find-links wheels\ngc-tinypkg==0.1\n", {}) == [
        "--find-links wheels",
        "--no-index",  # uv writes no line for it
        "gc-tinypkg==0.1",
    ]
    assert uv_env.pinned_lines("--index-url https://x\ntorch==2.13.0\n", {"torch": "2.13.0"}) == []
