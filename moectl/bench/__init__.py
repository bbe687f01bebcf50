"""Benchmarks behind `moectl bench ...`: libraries that return rows; the CLI renders and saves them."""
