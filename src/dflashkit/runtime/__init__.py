"""Runtime services: environment fingerprint (doctor), self-checks, compile safety."""
