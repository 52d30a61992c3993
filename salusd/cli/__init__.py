"""The `salusd` command and the clients it is made of: `main` (the parser and `serve`), `run`
(`salusd run`, a script under the daemon's turns), `array`, `logs`, `relay` and `rest` (its
other subcommands), `control` (the small client of the daemon's socket they share) and
`launch` (a daemon started in a subprocess, for the demo, the benches and the tests)."""
