from tests.training.conftest import oracle_model, oracle_run  # noqa: F401 - the training tests' run fixtures
