# A resourceAllocator in the shape of seed 000's "Example resource allocation policy structure":
# class AIOSv1PolicyRule, __init__(rule_id, settings, parameters), eval(parameters, input_data,
# context) returning {"node_id", "gpus"} for allocation/scale/reassignment and
# {"selection_score_data": {"score", "node_info"}} for dry_run. First fit over the healthy nodes
# (in node id order) of the payload's cluster_metrics; whole GPUs only. It counts its calls per
# action in the shared context. It does not choose instances to remove (scale_down): it returns
# nothing for that action, and the framework removes the least loaded, newest instance.
class AIOSv1PolicyRule:
    def __init__(self, rule_id, settings, parameters):
        """
        Initializes an AIOSv1PolicyRule instance.
        Args:
            rule_id (str): Unique identifier for the rule.
            settings (dict): Configuration settings for the rule.
            parameters (dict): Parameters defining the rule's behavior.
        """
        self.rule_id = rule_id
        self.settings = settings
        self.parameters = parameters

    def eval(self, parameters, input_data, context):
        """
        Evaluates the policy rule.
        input_data={
            "action": "dry_run"/ "allocation" / "scale" / "reassignment",
            "payload": <as defined in the previous section based on the action>
        }
        """
        action = input_data['action']
        payload = input_data['payload']
        context[action] = context.get(action, 0) + 1
        block = payload['block']
        wanted = block['resources']['gpus']
        nodes = payload['cluster_metrics']['nodes']
        free = {}
        for node_id in sorted(payload['healthy_nodes']):
            node = nodes[node_id]
            free[node_id] = [g['id'] for g in node['gpus'] if g['instances'] == 0 and not g['exclusive']]

        if action in ["allocation", "scale", "reassignment"]:
            avoid = None
            if action == "reassignment":
                avoid = block['instances'].get(payload['instance_id'], {}).get('node')
            for node_id, gpus in free.items():
                if node_id != avoid and len(gpus) >= wanted:
                    return {
                        # node_id where the instance will be scheduled
                        "node_id": node_id,
                        # gpu_ids that will be assigned to the instance
                        "gpus": gpus[:wanted],
                    }
            raise Exception(f"no node has {wanted} free GPUs")

        elif action == "dry_run":
            placed = 0
            first = {}
            for node_id, gpus in free.items():
                while len(gpus) >= wanted and placed < block['maxInstances']:
                    if not first:
                        first = {"node_id": node_id, "gpus": gpus[:wanted]}
                    gpus = gpus[wanted:]
                    placed += 1
                    if wanted == 0:
                        break
            return {
                "selection_score_data": {
                    # feasibility score - must be between 0-1, 1 means max feasibility
                    "score": placed / block['maxInstances'],
                    "node_info": first,
                }
            }
        # any other action (scale_down: which instance to remove) is not this policy's business:
        # answering nothing leaves the choice to the framework's default (docs/policies.md)
        return None
