"""Processes the tests start: a redis-server, a second remote-tier worker, hf-prefix-cache serve."""
