pytest_plugins = ["tests.cluster_fixtures"]
