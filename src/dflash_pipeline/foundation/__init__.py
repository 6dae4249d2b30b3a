"""The foundation: errors, files, configuration, devices, statistics and progress; imports no other wing."""
