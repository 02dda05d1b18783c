"""The examples of integrations/, each run with the real outside library on the real SmolLM2."""
