"""flowerapp: A Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedpriv_flwr import PrivateStrategy  # fedpriv
from flowerapp.task import Net

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""

    # Read run config
    fraction_evaluate: float = context.run_config["fraction-evaluate"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["learning-rate"]
    cfg = context.run_config  # fedpriv

    # Load global model
    torch.manual_seed(context.run_config["seed"])
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize FedAvg strategy
    strategy = FedAvg(fraction_evaluate=fraction_evaluate)
    strategy = PrivateStrategy(  # fedpriv: user-level DP around FedAvg
        strategy,  # fedpriv
        num_users=cfg["num-users"],  # fedpriv
        num_rounds=num_rounds,  # fedpriv
        evaluate_every=num_rounds,  # fedpriv: the nodes fine-tune and evaluate after the last
        epsilon=cfg["epsilon"],  # fedpriv
        delta=cfg["delta"],  # fedpriv
        clip_norm=cfg["clip-norm"],  # fedpriv
        clip_quantile=cfg["clip-quantile"],  # fedpriv
        seed=cfg["seed"],  # fedpriv
        results_path=cfg["results-path"],  # fedpriv
    )  # fedpriv

    # Start strategy, run FedAvg for `num_rounds` (the result's `arrays`: the final model)
    strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
    )
