"""flowerapp: A Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedpriv_flwr.personal import fit_personal, personalize  # fedpriv
from flowerapp.task import Net, load_data
from flowerapp.task import test as test_fn
from flowerapp.task import train as train_fn

# Flower ClientApp
mods = [personalize(r"^fc3\.", schedule="finetune")]  # fedpriv: fc3 is the personal head
app = ClientApp(mods=mods)  # fedpriv, was: app = ClientApp()


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""

    # Load the model and initialize it with the received weights
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    batch_size = context.run_config["batch-size"]
    seed = context.run_config["seed"]
    trainloader, _ = load_data(partition_id, num_partitions, batch_size, seed)

    # Call the training function
    steps, head_lr = context.run_config["head-steps"], context.run_config["head-lr"]  # fedpriv
    fit_personal(model, context, trainloader, steps, head_lr)  # fedpriv: fedrep: the head first
    train_loss = train_fn(
        model,
        trainloader,
        context.run_config["local-steps"],
        msg.content["config"]["lr"],
        device,
    )

    # Construct and return reply Message
    model_record = ArrayRecord(model.state_dict())
    metrics = {
        "train_loss": train_loss,
        "num-examples": len(trainloader.dataset),
    }
    metric_record = MetricRecord(metrics)
    content = RecordDict({"arrays": model_record, "metrics": metric_record})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""

    # Load the model and initialize it with the received weights
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    model.to(device)

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    batch_size = context.run_config["batch-size"]
    seed = context.run_config["seed"]
    trainloader, valloader = load_data(partition_id, num_partitions, batch_size, seed)

    steps, head_lr = context.run_config["head-steps"], context.run_config["head-lr"]  # fedpriv
    fit_personal(model, context, trainloader, steps, head_lr)  # fedpriv: this node's head

    # Call the evaluation function
    eval_loss, eval_acc = test_fn(model, valloader, device)

    # Construct and return reply Message
    metrics = {
        "eval_loss": eval_loss,
        "eval_acc": eval_acc,
        "num-examples": len(valloader.dataset),
    }
    metric_record = MetricRecord(metrics)
    content = RecordDict({"metrics": metric_record})
    return Message(content=content, reply_to=msg)
