"""Every collective the engine issues, with accounting, ZeRO++ quantised variants and the sequence check."""
